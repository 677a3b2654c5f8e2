"""A simulated accelerator, so that device mix-ups and host syncs show up in tests without a GPU.

Inside `SimulatedDevice()`, tensors created on the device `SIM` (or on "cuda", which megatron-core
asks for) are `DeviceTensor`s: they report `SIM` as their device but hold a CPU tensor and compute
with it, so real models train. Every op that mixes them with CPU tensors is checked the way CUDA
checks it, and every host read is recorded:

  - a CPU tensor of one or more dimensions next to a device tensor is an error (CUDA's "Expected
    all tensors to be on the same device"); 0-dim CPU tensors pass as scalars, as on CUDA, but
    not as the destination of an in-place op; indices of `index`/`index_put_` may be on the CPU;
  - a collective (all-reduce, all-gather, ...) given a CPU tensor is an error (NCCL's "No backend
    type associated with device type cpu"); with device tensors it runs on gloo underneath;
  - `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a blocking copy to the CPU, `bool(tensor)`
    and ops whose output size depends on the data (`nonzero`, `masked_select`, ...) are host
    syncs on a GPU: each is recorded in `syncs` with the first project frame that caused it.

`SIM` is the `meta` device type (autograd asks a CUDA device for its stream, which needs a
driver; it asks a meta device for nothing), so code that branches on `device.type == "cuda"` takes
its non-CUDA branch here; everything else is the code path a GPU run takes.
"""
from __future__ import annotations

import contextlib
import importlib
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

SIM = torch.device("meta")
_CROSS_DEVICE_OK = {"aten.copy_.default", "aten._to_copy.default", "aten.index.Tensor",
                    "aten.index_put_.default", "aten._index_put_impl_.default", "aten.lift_fresh.default"}
_DATA_DEPENDENT = ("aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique",
                   "aten.repeat_interleave.Tensor", "aten.bincount")


class DeviceMixup(RuntimeError):
    pass


def _is_sim_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # an integer device is a CUDA index
    device = torch.device(device)
    return device.type in ("meta", "cuda")


class DeviceTensor(torch.Tensor):
    """A tensor on the simulated device; `elem` is the CPU tensor that holds its values."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=SIM, requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self):
        return f"DeviceTensor({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sim = _current
        flat, _ = tree_flatten((args, kwargs))
        if name.startswith("c10d."):
            _check_collective(name, flat)
        elif name not in _CROSS_DEVICE_OK:
            for i, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.device.type == "cpu":
                    mutated = i == 0 and (name.split(".")[1].endswith("_") or "out" in kwargs)
                    if t.dim() > 0 or mutated:
                        raise DeviceMixup(f"{name}: Expected all tensors to be on the same device, but "
                                          f"found at least two devices, {SIM} and cpu (a CPU tensor of "
                                          f"shape {tuple(t.shape)})")
        if sim is not None:
            if name == "aten._local_scalar_dense.default":
                sim.record("item", name)
            elif name.startswith(_DATA_DEPENDENT) or _boolean_indexing(name, args):
                sim.record("data-dependent shape", name)
        def unwrap(t):
            return t.elem if isinstance(t, DeviceTensor) else t
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": torch.device("cpu")}  # e.g. new_zeros(..., device=the reported one)
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if name == "aten._to_copy.default" and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            return out
        return tree_map(lambda t: DeviceTensor(t) if type(t) is torch.Tensor else t, out)


def _boolean_indexing(name: str, args) -> bool:
    """Indexing with a boolean mask needs the mask's nonzero positions on the host, except
    `t[mask] = scalar`, which torch runs as a masked_fill."""
    if not name.startswith(("aten.index.", "aten.index_put", "aten._index_put_impl_")):
        return False
    masks = [t for t in args[1] if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return False
    if name.startswith("aten.index."):
        return True
    value = args[2]
    return not (len(args[1]) == 1 and masks[0].shape == args[0].shape[:masks[0].dim()] and value.numel() == 1)


def _check_collective(name: str, flat: list):
    """NCCL takes device tensors only. torch's *_object collectives and barrier are exempt: with
    NCCL they use device tensors of their own (here the group is gloo, so they do not)."""
    if name.startswith("c10d.barrier"):
        return
    if any(isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.device.type == "cpu"
           for t in flat):
        if any(f.name.endswith("_object") and f.filename.endswith("distributed_c10d.py")
               for f in traceback.extract_stack()):
            return
        raise DeviceMixup(f"{name}: a CPU tensor handed to a collective of the device's backend "
                          "(NCCL: No backend type associated with device type cpu)")


def to_device(t: torch.Tensor) -> DeviceTensor:
    return t if isinstance(t, DeviceTensor) else DeviceTensor(t)


@dataclass
class Sync:
    kind: str
    op: str
    where: str  # the first frame in megatron_kappa/, else the first outside torch


@dataclass
class SimulatedDevice:
    syncs: list = field(default_factory=list)

    def record(self, kind: str, op: str):
        frames = [f for f in traceback.extract_stack()[:-2] if "simulated_device" not in f.filename]
        ours = [f for f in frames if "/megatron_kappa/" in f.filename]
        lib = [f for f in frames if "/torch/" not in f.filename]
        frame = (ours or lib or frames)[-1]
        self.syncs.append(Sync(kind, op, f"{frame.filename.split('/site-packages/')[-1]}:{frame.lineno}"))

    def project_syncs(self) -> list:
        return [s for s in self.syncs if "megatron_kappa/" in s.where]

    def __enter__(self):
        global _current
        from megatron_kappa.parallel import compat

        compat.apply("cpu")  # the CUDA API stand-ins; the device placement is undone below
        self._stack = contextlib.ExitStack()
        def patch(obj, name, value):
            return self._stack.enter_context(_setattr(obj, name, value))
        patch(torch.cuda, "current_device", lambda: 0)  # megatron's "the GPU"
        patch(torch.cuda, "synchronize", lambda *a, **k: self.record("synchronize", "torch.cuda.synchronize"))
        for module in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
            patch(importlib.import_module(module), "get_default_causal_mask", _causal_mask_on_device)
        self._stack.enter_context(_SimMode(self))
        self._stack.enter_context(_SimFactories())
        _current = self
        return self

    def __exit__(self, *exc):
        global _current
        _current = None
        self._stack.close()


_current: SimulatedDevice | None = None


@contextlib.contextmanager
def _setattr(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _causal_mask_on_device(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device=torch.cuda.current_device()), diagonal=1).bool()


class _SimMode(TorchFunctionMode):
    """Creates tensors on the simulated device when asked for it, moves them there and back."""

    def __init__(self, sim: SimulatedDevice):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if func == torch.Tensor.data.__set__:  # `t.data = other`: the wrapper must follow
            result = func(*args, **kwargs)
            if isinstance(args[0], DeviceTensor):
                args[0].elem = args[1].elem if isinstance(args[1], DeviceTensor) else args[1]
            return result
        if func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
            # torch would make the number a tensor on the reported (meta) device, without data
            return func(args[0], args[1], torch.tensor(args[2]))
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item) and isinstance(args[0], DeviceTensor):
            self.sim.record(func.__name__, f"Tensor.{func.__name__}")
            return func(args[0].elem, *args[1:], **kwargs)
        if "device" in kwargs and _is_sim_device(kwargs["device"]):
            kwargs["device"] = "cpu"
            return tree_map(lambda t: DeviceTensor(t) if type(t) is torch.Tensor else t, func(*args, **kwargs))
        return func(*args, **kwargs)

    def _move(self, func, args, kwargs):
        t = args[0]
        if func is torch.Tensor.cuda:
            device, dtype, non_blocking = SIM, None, kwargs.get("non_blocking", False)
        elif func is torch.Tensor.cpu:
            device, dtype, non_blocking = torch.device("cpu"), None, False
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        on_sim = isinstance(t, DeviceTensor)
        if device is None or (on_sim and _is_sim_device(device)):  # no move: torch's own op (autograd intact)
            return t if dtype is None or dtype == t.dtype else torch.Tensor.to(t, dtype)
        if _is_sim_device(device):  # host → device
            if t.requires_grad:
                raise NotImplementedError("simulated device: moving a tensor that requires grad to the device")
            return DeviceTensor(t.to(dtype) if dtype is not None else t.clone())
        if on_sim:  # device → host
            if t.requires_grad:
                raise NotImplementedError("simulated device: moving a tensor that requires grad to the host")
            if not non_blocking:
                self.sim.record("copy to host", "Tensor.to(cpu)" if func is torch.Tensor.to else "Tensor.cpu")
            return t.elem.to(dtype) if dtype is not None else t.elem
        return func(*args, **kwargs)


class _SimFactories(TorchDispatchMode):
    """Tensors that C++ creates on the reported device (backward formulas make their zeros from
    the gradient's options) become simulated-device tensors with data, not empty meta ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func).startswith("c10d."):
            _check_collective(str(func), tree_flatten((args, kwargs))[0])
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            flat, _ = tree_flatten((args, kwargs))
            if not any(isinstance(t, torch.Tensor) for t in flat):
                out = func(*args, **{**kwargs, "device": torch.device("cpu")})
                return tree_map(lambda t: DeviceTensor(t) if type(t) is torch.Tensor else t, out)
        return func(*args, **kwargs)


def on_device(module: torch.nn.Module) -> torch.nn.Module:
    """Move a CPU-built module's parameters and buffers to the simulated device in place, keeping
    the Parameter objects (and the attributes megatron puts on them)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, DeviceTensor):
                new = torch.nn.Parameter(DeviceTensor(p.detach()), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                m._parameters[name] = new
        for name, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, DeviceTensor):
                m._buffers[name] = DeviceTensor(b)
    return module


def world_of_one():
    if not dist.is_initialized():
        from megatron_kappa.parallel.launch_env import free_port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
