"""Every patch the stack needs to run on the CPU (gloo), in one place, applied only there.

`apply(device)` is called once per process before the first model build (by
megatron_kappa.parallel.groups.init_distributed) and does nothing unless the device is the CPU.
It covers megatron-core 0.19.2 (the sites below), megatron's jit_fuser (torch.compile: a cold
start per process on CPU; its functions run eager there, Dynamo stays on for model.compile) and DeepSpeed's JIT-built
ops (a 25-40 s compile each; the
shm comm op serves only inference, and the optimizer is torch's). `PATCHED` lists each library
symbol replaced here; tests/test_compat.py checks they all still exist, so an upgrade that moves
one fails loudly instead of silently unpatched.

What breaks on a CPU without each patch (megatron-core 0.19.2):
  - CUDA RNG tracker (`tensor_parallel/random.py`, forked in every attention forward): "Found no
    NVIDIA driver"; the tracker keeps CPU generator states instead.
  - `torch.cuda.current_device/Stream/Event/current_stream/stream/synchronize`, called without a
    device check by the global memory buffer, RoPE, the router, the expert bias, the alltoall
    dispatcher's side stream and the TP mappings: pointed at CPU stand-ins.
  - the default causal mask is built with device="cuda": built on the CPU.
  - `tensor.record_stream(stream)` (the EP-overlap schedule, models/gpt/fine_grained_callables.py
    and pipeline_parallel/utils.py) takes a stream: the stand-in makes it a no-op.
  - `maybe_move_tensor_to_cpu(as_numpy=True)` converts only CUDA tensors, and gloo's
    all_to_all_single wants the split sizes as lists (EP > 1): CPU tensors are converted too.
  - `_gather_along_first_dim(output_split_sizes=...)` uses an uneven list all_gather, which gloo
    lacks (ETP > 1 with EP > 1): pad to the largest split, gather, strip.
  - `get_pos_emb_on_this_cp_rank` (RoPE under context parallelism) builds its chunk index in
    pinned memory and moves it with `.cuda()`: the same index on the embedding's device.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch

# (module, attribute) pairs replaced by apply().
PATCHED = [
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add"),
    ("megatron.core.transformer.utils", "get_default_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
    ("megatron.core.pipeline_parallel.schedules", "torch"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
]
# torch.cuda entry points megatron calls unconditionally; pointed at CPU stand-ins.
CUDA_SHIMMED = ["current_device", "Stream", "Event", "current_stream", "stream", "synchronize"]

# DeepSpeed ops kept from JIT-compiling on CPU.
DEEPSPEED_OPS_OFF = ["deepspeed_shm_comm"]

_applied = False


def applied() -> bool:
    return _applied


def _resolve(module: str, attr: str):
    obj = importlib.import_module(module)
    *owners, name = attr.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    return obj, name


def missing_symbols(entries=None, cuda_names=None) -> list[str]:
    """The library symbols this module would replace that do not exist (meaningful only before
    `apply`, which would otherwise have put them there)."""
    missing = []
    for module, attr in PATCHED if entries is None else entries:
        try:
            obj, name = _resolve(module, attr)
            if not hasattr(obj, name):
                missing.append(f"{module}.{attr}")
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attr}")
    missing += [f"torch.cuda.{n}" for n in (CUDA_SHIMMED if cuda_names is None else cuda_names)
                if not hasattr(torch.cuda, n)]
    return missing


class _NoStream:
    """A CUDA stream/event stand-in: on CPU every op is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # wait_stream, record_event, synchronize, record, wait, ...
        return lambda *args, **kwargs: self if name == "record_event" else None

    def query(self):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # `tensor.record_stream(stream)` (megatron's EP-overlap schedule keeps a tensor alive for
        # another stream) is the one torch call that takes a stream: nothing to record on the CPU
        if func is torch.Tensor.record_stream:
            return None
        return NotImplemented


def _shim_cuda():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _rng_tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add on the CPU generator (site 1)."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _move_to_cpu(tensor, as_numpy=False, record_stream=False):
    # Upstream converts only CUDA tensors to numpy; gloo's all_to_all_single wants lists (site 10).
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


class _TorchOnCPU(types.ModuleType):
    """torch as megatron's pipeline schedules see it on the CPU: `zeros(..., device="cuda")`
    (their token counter) lands on the CPU; everything else is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron's get_pos_emb_on_this_cp_rank with its index on pos_emb's device: chunks r and
    2·cp−1−r of 2·cp."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def _make_gather_along_first_dim(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        # gloo has no uneven list all_gather (site 11): pad to the largest split, gather, strip.
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        biggest = max(output_split_sizes)
        padded = input_.new_zeros((biggest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((biggest * group.size(), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        parts = out.split(biggest)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    return gather


def apply(device: torch.device | str = "cpu") -> bool:
    """Patch for CPU runs. Returns True when patches were (or already are) applied."""
    global _applied
    if _applied or torch.device(device).type != "cpu":
        return _applied
    missing = missing_symbols()
    if missing:  # patching would add them, and nothing upstream would call them
        raise RuntimeError(f"megatron_kappa.parallel.compat: {', '.join(missing)} no longer exist "
                           "upstream; review the CPU patches for this library version")
    # megatron's jit_fuser is torch.compile: a 20 s cold start per process on CPU, where eager is
    # the default. Its functions run eager; model.compile true compiles them inside each layer
    # (megatron_kappa.model.compile). Dynamo itself stays on.
    importlib.import_module("megatron_kappa.model.compile").eager_fusers()
    ds_ops = importlib.import_module("deepspeed.ops")
    for op in DEEPSPEED_OPS_OFF:
        ds_ops.__compatible_ops__[op] = False
    _shim_cuda()
    # Dynamo's table of torch functions is built by name (again at every init_process_group), so it
    # takes the stand-in for torch.cuda.current_device, a function it folds to a constant: the
    # stand-in is folded too (model.compile; else a graph break at each of megatron's device moves)
    importlib.import_module("torch._dynamo.variables.torch").constant_fold_functions[torch.cuda.current_device] = None
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    rnd._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    rnd._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    rnd.CudaRNGStatesTracker.add = _rng_tracker_add
    for module in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
        importlib.import_module(module).get_default_causal_mask = _causal_mask
    for module in ("megatron.core.transformer.moe.moe_utils",
                   "megatron.core.transformer.moe.token_dispatcher"):  # imported by name there
        importlib.import_module(module).maybe_move_tensor_to_cpu = _move_to_cpu
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    mappings._gather_along_first_dim = _make_gather_along_first_dim(mappings._gather_along_first_dim)
    importlib.import_module("megatron.core.pipeline_parallel.schedules").torch = _TorchOnCPU("torch")
    for module in ("rope_utils", "rotary_pos_embedding", "yarn_rotary_pos_embedding"):  # imported by name there
        importlib.import_module(f"megatron.core.models.common.embeddings.{module}").get_pos_emb_on_this_cp_rank = \
            _pos_emb_on_this_cp_rank
    _applied = True
    return True
