"""The one registry mechanism that every kind uses (attention kinds, routers, κ inputs, export targets).

The attention kinds (megatron_kappa.attention_kinds), the routers (megatron_kappa.routers), the κ
input variants (megatron_kappa.kappa.inputs) and the export targets (megatron_kappa.export.targets)
are each a `Registry` of entries under one config key.

A registry maps a name to an entry (a frozen dataclass of the kind's facts). `register` adds one, at
import or at run time (a config validated after it accepts the name), and checks its name, its type
and the callables the kind needs; a name is registered once (the same entry again is a no-op).

Pieces: an entry's facts are torch-free and written beside the registry, but some of a built-in
entry's parts need torch and megatron-core (a router's classes, MLA's attention spec). The entry
holds a `Given` placeholder for each (`Registry.piece`); the module that defines the part hands it
over when it is imported (`Registry.implement`), and calling the placeholder calls what was handed
over. So the registry's module imports nothing of the later stages, an entry copied by
dataclasses.replace before that module was imported still reaches the part, and a part called too
early says so in one line. An entry registered at run time gives its callables itself.

This module imports nothing of the package.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Generic, Iterator, Optional, TypeVar

Entry = TypeVar("Entry")


class Given:
    """A built-in entry's piece that its module hands over when imported (`Registry.implement`);
    calling it calls that."""

    def __init__(self, registry: "Registry", name: str, piece: str):
        self.registry, self.name, self.piece = registry, name, piece

    def __call__(self, *args, **kwargs):
        handed = self.registry.handed_piece(self.name, self.piece)
        if handed is None:
            raise RuntimeError(f"{self.registry.key}: {self.name}: its {self.piece} comes from "
                               f"{self.registry.pieces_in}/{self.name}.py, which is not imported yet "
                               "(build_model imports it)")
        return handed(*args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, Given) and self.registry is other.registry and \
            (self.name, self.piece) == (other.name, other.piece)

    def __hash__(self):
        return hash((id(self.registry), self.name, self.piece))

    def __repr__(self):
        return f"Given({self.registry.key!r}, {self.name!r}, {self.piece!r})"


class Registry(Mapping, Generic[Entry]):
    """{name: entry} of one kind, read as a mapping (in registration order) and changed only through
    `register` / `unregister`.

    key        the config key (or option) that names an entry: every error message starts with it
    entry      the entry's class (register refuses anything else)
    noun       what an entry is called in messages ("router": "a router's name must be ...")
    needs      the entry's fields that must be callable
    default    the entry that stays registered (unregister refuses it)
    pieces_in  the folder of the modules that hand over the built-in entries' pieces (messages)
    check      (name, entry, registry) → None, raising ValueError: the kind's own rule for an entry
    error      the exception `lookup` raises for an unknown name
    """

    def __init__(self, key: str, entry: type, *, noun: str, needs: tuple[str, ...] = (), default: Optional[str] = None,
                 pieces_in: str = "", check: Optional[Callable] = None, error: type = ValueError):
        self.key, self.entry, self.noun, self.needs = key, entry, noun, needs
        self.default, self.pieces_in, self.check, self.error = default, pieces_in, check, error
        self._entries: dict[str, Entry] = {}
        self._handed: dict[tuple[str, str], Callable] = {}  # (name, piece) → what its module handed over

    # --- the mapping ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self):
        return f"Registry({self.key!r}, {list(self._entries)})"

    # --- changing it ---------------------------------------------------------------------------------
    def register(self, name: str, entry: Entry) -> Entry:
        """Add `entry` as `name` (a config validated after this accepts it). A name is registered once."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{self.key}: a {self.noun}'s name must be an identifier, got {name!r}")
        if not isinstance(entry, self.entry) or not all(callable(getattr(entry, f, None)) for f in self.needs):
            needs = self.needs[0] if len(self.needs) == 1 else ", ".join(self.needs[:-1]) + " and " + self.needs[-1]
            with_ = f" with {'a ' if len(self.needs) == 1 else ''}callable {needs}" if self.needs else ""
            raise TypeError(f"{self.key}: {name}: expected a {self.entry.__name__}{with_}, got {entry!r}")
        if name in self._entries and self._entries[name] != entry:
            raise ValueError(f"{self.key}: {name} is already registered")
        if self.check is not None:
            self.check(name, entry, self)
        self._entries[name] = entry
        return entry

    def unregister(self, name: str):
        """Remove an entry registered at run time (tests)."""
        if name == self.default:
            raise ValueError(f"{self.key}: {name} is the default and stays registered")
        self._entries.pop(name, None)

    # --- reading it ----------------------------------------------------------------------------------
    def lookup(self, name: str) -> Entry:
        """The entry `name` (`error` naming the key and the registered names otherwise)."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self.error(f"{self.key}: expected one of {list(self._entries)}, got {name!r}") from None

    def names(self, where: Callable[[Entry], bool] = lambda entry: True) -> list[str]:
        """The registered names, in registration order, of the entries `where` holds for."""
        return [name for name, entry in self._entries.items() if where(entry)]

    # --- the pieces ----------------------------------------------------------------------------------
    def piece(self, name: str, piece: str) -> Given:
        """The placeholder of built-in entry `name`'s `piece`, which its module hands over."""
        return Given(self, name, piece)

    def implement(self, name: str, **pieces: Callable):
        """Hand over the pieces of the built-in entry `name` that it leaves to its module (called once,
        by that module, when it is imported)."""
        entry = self.lookup(name)
        for piece, handed in pieces.items():
            if getattr(entry, piece, None) != Given(self, name, piece) or not callable(handed):
                raise ValueError(f"{self.key}: {name}: {piece} is not a piece its entry leaves to its module")
            self._handed[(name, piece)] = handed

    def handed_piece(self, name: str, piece: str) -> Optional[Callable]:
        return self._handed.get((name, piece))

    def handed(self, entry: Entry) -> dict[str, Optional[Callable]]:
        """{field: what was handed over for it, None while not} of `entry`'s placeholders (tests)."""
        return {f: self._handed.get((v.name, v.piece)) for f, v in vars(entry).items() if isinstance(v, Given)}
