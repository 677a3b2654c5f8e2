"""A dead or hung rank: which one, said by the ranks that are left.

What ends the job, and how fast (`parallel.timeout_s`, T; megatron_kappa.parallel.groups):
  - a rank that dies: its peers' next collective fails at once on gloo (connection closed), or
    after T on NCCL. The launcher ends the other ranks, but which rank it names first is a race:
    a survivor's error can reach srun before the dead rank's "Killed" (and a survivor may even
    see its connection to another survivor close first). So the survivors name the dead ones
    themselves, by a roll call (`missing_ranks()`; megatron_kappa.parallel.roll_call) through the
    rendezvous store, which every live rank's answerer thread answers even while the rank is
    blocked in a collective; who does not answer within a few seconds is gone, named with its
    host. If the store itself is gone, its host (rank 0's) is the one lost.
  - a rank that hangs (alive, never reaching the collective): its peers' collective times out
    after T. They cannot tell from that error whom they waited for, so `explain()` asks: a
    monitored barrier on a gloo group kept for it (groups.barrier_group), where rank 0 waits up
    to T for each rank and names those that do not come ("Ranks 1 failed to pass monitoredBarrier"; rank 0 itself hung:
    the others say "errors while waiting for send/recv from rank 0"). The ranks then exit with
    an error and the launcher ends the hung one. Bound: about 2 T.
On NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) a timed-out collective is noticed by torch's watchdog
thread, which takes the process down itself, naming its own rank and the collective; the Python
exception, and so `explain()`, may never run. Not tested here (no GPUs): torch's flight recorder
(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT) then says which rank lagged.
"""
from __future__ import annotations

import datetime
import re

import torch.distributed as dist

from megatron_kappa.parallel import groups, roll_call

# What gloo's and NCCL's errors say when a peer is gone or late (they raise a bare RuntimeError).
_MARKS = ("gloo", "nccl", "timed out", "connection closed", "connection reset", "broken pipe")


def _short(text: str) -> str:
    """gloo's first line without its source location and advice: "[.../pair.cc:545] Read error
    [127.0.0.1]:16819: Connection reset by peer. This is typically ..." -> "Read error ...peer"."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    return line.split(". This is typically")[0].rstrip(".")


def is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _MARKS)


def where(message: str) -> str:
    """" (on node2: ranks 2, 3)" for the ranks a monitored-barrier message names
    ("Ranks 2, 3 failed to pass monitoredBarrier"), from the host names gathered at start."""
    hosts = groups.rank_hosts()
    m = re.search(r"Ranks? ([\d, ]+) failed", message)
    if not hosts or not m:
        return ""
    return _on_hosts([int(r) for r in re.findall(r"\d+", m.group(1)) if int(r) < len(hosts)])


def _on_hosts(ranks: list[int]) -> str:
    """" (on node2: ranks 2, 3)" from the host names gathered at start (the ranks alone before)."""
    hosts = groups.rank_hosts()
    if not hosts:
        return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    on = {}
    for r in ranks:
        on.setdefault(hosts[r] if r < len(hosts) else "?", []).append(str(r))
    return "".join(f" (on {h}: rank{'s' if len(rs) > 1 else ''} {', '.join(rs)})" for h, rs in on.items())


def missing_ranks(window_s: float) -> str:
    """Call the roll (megatron_kappa.parallel.roll_call) and wait up to `window_s` for every
    rank's answerer: those that never answer are gone. One line naming them and their hosts; the
    store's own host when the store cannot be reached."""
    hosts = groups.rank_hosts() or []
    try:
        missing = roll_call.absent(window_s)
    except Exception:  # the store is rank 0's (srun, mp.spawn) or the launcher's
        host0 = hosts[0] if hosts else "rank 0's host"
        return f"the rendezvous store (rank 0's, on {host0}) cannot be reached: {host0} is lost, or " \
               f"this host's link"
    if missing is None:
        return "a peer closed its connection: a rank has died"
    if not missing:
        return "every rank answered a roll call afterwards: a transient network error"
    return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, sorted(missing)))} did not " \
           f"answer a roll call within {window_s:g} s: gone{_on_hosts(sorted(missing))}"


def _peer_closed(exc: BaseException) -> bool:
    """A connection that a peer closed or reset (it died), as opposed to a collective timing out."""
    text = str(exc).lower()
    return "timed out" not in text and "timeout" not in text and \
        any(m in text for m in ("connection closed", "connection reset", "broken pipe", "connection refused"))


def unresponsive_ranks(timeout_s: float) -> str:
    """Rank 0 waits up to `timeout_s` for every rank at a barrier on its own gloo group; what it
    (or, on the other ranks, their exchange with rank 0) found, as one line."""
    try:
        dist.monitored_barrier(group=groups.barrier_group(),
                               timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        found = _short(str(e)) or type(e).__name__
        if "monitoredbarrier" in found.lower():
            return found + where(found)
        return (f"a peer closed its connection ({found}): a rank has died; the launcher names it "
                "(srun: 'task N')")
    return "every rank answered a barrier afterwards: a transient network error, or a rank that " \
           "was only slow"


def names_the_lost(note: str) -> bool:
    """Whether explain()'s line says who is gone or hung (a rank, a host, the store): then it is the
    whole story, and the collective's traceback (about 100 lines of gloo's through the checkpoint
    code) adds nothing. Not when every rank answered: that failure is not understood."""
    return "every rank answered" not in note


def explain(exc: BaseException) -> str | None:
    """For an exception out of training: None unless it is a collective that failed in a world
    of several ranks; else one line naming the ranks that did not answer (see the module)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if not is_collective_failure(exc):
        return None
    timeout_s = groups.collective_timeout_s()
    found = missing_ranks(min(10.0, timeout_s)) if _peer_closed(exc) else unresponsive_ranks(timeout_s)
    return f"a collective failed ({_short(str(exc)) or type(exc).__name__}); {found}"
