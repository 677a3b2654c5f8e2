"""The roll call: who is still alive, asked through the rendezvous store.

Every rank starts an answerer when its groups are made (megatron_kappa.parallel.groups) and
stops it at their teardown; after a failure, a survivor calls the roll (`absent`) and
megatron_kappa.parallel.failures says in words who did not answer. Its own module because both
of those use it: the groups own its lifetime, the failures read it, and neither imports the
other for it.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d

_answerer: dict | None = None  # this rank's answerer: thread, store, key prefix


def start_answering(generation: int):
    """Start this rank's answerer (every rank, once its groups exist): a thread waiting on the
    rendezvous store, on its own connection, for a roll call, and answering it. A thread, because
    a rank that is alive may still be blocked inside a collective (on a survivor that is itself
    in the roll call): it must answer all the same. Idle, it is one pending wait on the store."""
    global _answerer
    # the same on every rank: the job's restart count and the how-many-th group of this process
    prefix = f"kappa_roll_call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
        f"{os.environ.get('SLURM_RESTART_COUNT', '0')}/{generation}/"
    default = distributed_c10d._get_default_store()
    store = default.clone()  # the thread's own connection: a pending wait blocks its client
    me = dist.get_rank()

    def answer():
        try:
            store.wait([prefix + "called"], datetime.timedelta(days=365))
            if store.get(prefix + "called") == b"call":
                store.set(prefix + f"here/{me}", "1")
        except Exception:  # the store is gone: nobody left to answer
            pass

    thread = threading.Thread(target=answer, name="kappa-roll-call", daemon=True)
    thread.start()
    _answerer = {"thread": thread, "store": default.clone(), "prefix": prefix}  # the caller's


def stop_answering(release: bool):
    """At the end of the groups. `release`: every rank is ending normally (after a barrier), so
    the answerers are released through the store; after a failure they are left (a live peer may
    still be calling)."""
    global _answerer
    if _answerer is not None and release:
        try:
            _answerer["store"].set(_answerer["prefix"] + "called", "end")
            _answerer["thread"].join(5)
        except Exception:  # the store is already gone
            pass
    _answerer = None


def absent(window_s: float) -> set[int] | None:
    """Call the roll and wait up to `window_s` for every rank's answerer: the ranks that never
    answer (empty when all did). None when this rank has no answerer (its groups were never
    made); whatever the store raises when it cannot be reached goes to the caller."""
    if _answerer is None:
        return None
    store, prefix = _answerer["store"], _answerer["prefix"]
    store.set(prefix + "called", "call")
    deadline, missing = time.monotonic() + window_s, set(range(dist.get_world_size()))
    while missing and time.monotonic() < deadline:
        missing = {r for r in missing if not store.check([prefix + f"here/{r}"])}
        if missing:
            time.sleep(0.2)
    return missing
