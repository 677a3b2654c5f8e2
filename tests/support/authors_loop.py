"""14c9b04's own training (askerlee/kappa-swiglu at the paper's date) on the CPU in fp32, for
tests/test_authors_loop.py: the authors' GPT, optimizer and schedules, run from the files vendored
unmodified under tests/authors_14c9b04/ (MIT; LICENSE and README.md there; `VENDORED` pins each
file's git blob id at 14c9b04, which the test checks).

What runs is theirs: the model (nanochat/gpt.py), the optimizer (nanochat/optim.py: AuroraAdamW,
its AdamW), and from scripts/base_train.py its argument parser and defaults (200-352), the κ aux-
weight rule (355-356), `build_model_meta` (548-598), the step count, κ delay, accumulation, batch
and weight-decay scaling and `setup_optimizer` call (771-896) and every schedule function (922-1069),
read from the file with ast and executed as written. The training step itself (1384-1420 and
1722-1822) sits inside base_train's `while True` with its logging, evaluation and checkpoints, so
`train` below transcribes it, line for line where it computes.

What this module changes, and nothing else:
1. NANOCHAT_DTYPE=float32 and NANOCHAT_ATTENTION_IMPL=sdpa: the authors' own switches (fp32
   compute on a machine that also has a GPU; PyTorch SDPA).
2. RoPE tables in fp32: gpt.py keeps them in bf16 (2135) and GPT.forward asserts it (2425). Here the
   tables come from the same formula without the bf16 cast, and that one assert is left out of
   GPT.forward (recompiled from its own source; the line is checked to occur once).
3. base_train builds on the meta device and calls to_empty (614-615), which leaves some buffers as
   uninitialised memory; they take their declared values here (a GPT built on the CPU from the same
   config): notably the κ path's router-gradient scale 0.1 (docs/authors_model.md §5).
4. Between micro-steps the MoE layers' reused dispatch buffers (gpt.py 1696-1740, added in 14c9b04
   itself, "safe only when each forward using this buffer is backpropped before reuse") are
   dropped, so the next micro-batch allocates fresh ones: in eager mode the reused buffer keeps
   micro-step 0's graph (already freed by its backward) and the second backward raises "Trying to
   backward through the graph a second time". The values are the same (the buffer is zeroed before
   every use).
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import io
import math
import os
import sys
import textwrap
import types
from pathlib import Path

import torch

VENDOR = Path(__file__).resolve().parents[1] / "authors_14c9b04"
COMMIT = "14c9b041f437d7ea583f9c7a27fa1755ff4ecb62"
VENDORED = {  # path: git blob id at 14c9b04 (git ls-tree 14c9b04)
    "LICENSE": "72d95c190c0d14341d5b0720e28c88fb58690821",
    "nanochat/__init__.py": "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391",
    "nanochat/common.py": "cec724da4dc4ebfdaf60d9c6db643a4de45e9e17",
    "nanochat/configuration_nanomoe_gpt.py": "7eb614c6b708d5931bf097017a141f34b1ddd967",
    "nanochat/flash_attention.py": "41da0ae3e6d780b1a88cdd45720189418e00e6af",
    "nanochat/gpt.py": "5717db2db8b94ba490af6474043b156696c503f6",
    "nanochat/manager.py": "87c5169b1b997a4766a06111d42efd454ad9fbff",
    "nanochat/optim.py": "4f99bebad44b9495819b9c3fdfed224dd34ee09f",
    "scripts/base_train.py": "db7cf726fb9ea5a1df51fb07f06272363ceb9e79",
}
BASE_TRAIN = VENDOR / "scripts" / "base_train.py"
BF16_ASSERT = 'assert self.cos.dtype == torch.bfloat16, "Rotary embeddings must be in bfloat16"\n'


def blob_id(path: Path) -> str:
    """git's blob id of a file: sha1 of "blob <size>\\0" + its bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def import_authors():
    """nanochat.gpt from the vendored files, with GPT.forward less its bf16 RoPE assert (2.)."""
    os.environ["NANOCHAT_DTYPE"] = "float32"
    os.environ["NANOCHAT_ATTENTION_IMPL"] = "sdpa"
    if str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))
    import nanochat.gpt as gpt
    if getattr(gpt.GPT.forward, "_fp32_rope", False):
        return gpt
    source = textwrap.dedent(inspect.getsource(gpt.GPT.forward))
    assert source.count(BF16_ASSERT) == 1, "14c9b04's GPT.forward no longer has its bf16 RoPE assert"
    space = {}
    exec(compile(source.replace(BF16_ASSERT, "pass\n"), inspect.getsourcefile(gpt.GPT), "exec"), gpt.__dict__, space)
    space["forward"]._fp32_rope = True
    gpt.GPT.forward = space["forward"]
    return gpt


class BaseTrain:
    """Top-level statements and functions of the vendored scripts/base_train.py, executed as written
    in one namespace (the script's globals), line ranges by their first and last line."""

    def __init__(self, argv: list[str], **names):
        self.tree = ast.parse(BASE_TRAIN.read_text())
        gpt = import_authors()
        from nanochat.configuration_nanomoe_gpt import GPTConfig
        self.ns = {"argparse": __import__("argparse"), "math": math, "torch": torch, "GPT": gpt.GPT,
                   "GPTConfig": GPTConfig, "get_moe_layer_indices": gpt.get_moe_layer_indices,
                   "print0": lambda *a, **k: None, "user_config": {}, "ddp_world_size": 1, "resuming": False,
                   "load_optimizer_state": False,
                   "sys": types.SimpleNamespace(argv=["base_train.py", *argv]), **names}
        self.functions("str2bool", "arg_was_explicitly_set", "build_model_meta", "get_lr_multiplier",
                       "get_muon_momentum", "get_weight_decay", "get_annealed_loss_weight",
                       "get_two_stage_annealed_loss_weight", "get_linear_lr_scale", "get_kappa_bias_lr_scale",
                       "get_kappa_slope_max_scale", "accumulate_step_losses", "average_step_losses")
        self.lines(200, 352)                       # the parser and its defaults
        self.ns["args"] = self.ns["parser"].parse_args(argv)
        self.lines(355, 356)                       # κ runs: aux weight halved unless given

    def functions(self, *names):
        nodes = [n for n in self.tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {n.name for n in nodes} == set(names)
        self._run(nodes)

    def lines(self, first: int, last: int):
        nodes = [n for n in self.tree.body if first <= n.lineno and n.end_lineno <= last]
        assert nodes, (first, last)
        self._run(nodes)

    def _run(self, nodes):
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(BASE_TRAIN), "exec"), self.ns)

    def __getattr__(self, name):
        try:
            return self.ns[name]
        except KeyError:
            raise AttributeError(name) from None


def declared_buffers(model, config, gpt):
    """The buffers to_empty left uninitialised, set to the values their modules declare (3.)."""
    with contextlib.redirect_stdout(io.StringIO()):
        twin = gpt.GPT(config)
    with torch.no_grad():
        declared = dict(twin.named_buffers())
        for name, buf in model.named_buffers():
            if name not in ("cos", "sin"):
                buf.copy_(declared[name])


def fp32_rope(model):
    """_precompute_rotary_embeddings (gpt.py 2122-2137) without its bf16 cast (2.)."""
    head_dim = model.config.n_embd // model.config.n_head
    channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (channel_range / head_dim))
    freqs = torch.outer(torch.arange(model.rotary_seq_len, dtype=torch.float32), inv_freq)
    model.cos, model.sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def build(argv: list[str], vocab_size: int) -> BaseTrain:
    """base_train's model and optimizer for a command line: `bt.orig_model`, `bt.optimizer`, the
    step count, accumulation and κ delay, as the script computes them (its lines 548-896)."""
    gpt = import_authors()
    bt = BaseTrain(argv, vocab_size=vocab_size)
    args = bt.args
    bt.ns["resolved_loss_chunk_tokens"] = args.loss_chunk_tokens
    with contextlib.redirect_stdout(io.StringIO()):
        model = bt.build_model_meta(args.depth)    # 612-618
        model.to_empty(device="cpu")
        model.init_weights()
    declared_buffers(model, model.config, gpt)
    fp32_rope(model)
    bt.ns.update(model=model, orig_model=model)
    bt.lines(771, 795)                             # tokens per micro-batch, total batch
    bt.lines(797, 812)                             # num_iterations
    bt.lines(817, 822)                             # κ delay: max(min, ceil(frac · iterations))
    with contextlib.redirect_stdout(io.StringIO()):
        bt.lines(834, 896)                         # accumulation, batch LR scale, weight decay, optimizer
    return bt


def train(bt: BaseTrain, batches: list[dict], record=None) -> list[dict]:
    """base_train's training step (1384-1420, 1722-1822) for bt.num_iterations steps over `batches`
    (grad_accum_steps each, in order). Returns per step the logged ntp_loss, the cross-entropy
    alone (ntp_loss − router_z_loss_weight · router_z_loss: their logged ntp_loss aliases the loss
    the z-loss is added to in place, gpt.py 2679-2687), U, κ's learning rate and the parameters."""
    from nanochat.gpt import MOELayer
    args, model, optimizer, num_iterations = bt.args, bt.model, bt.optimizer, bt.num_iterations
    delay, grad_accum_steps = bt.kappa_bias_delay_start_iterations, bt.grad_accum_steps
    batches = iter(batches)
    out = []
    for step in range(num_iterations):
        aux_loss_weight = bt.get_annealed_loss_weight(
            args.aux_loss_weight * args.aux_loss_weight_init_scale, step,
            num_anneal_iterations=args.aux_loss_weight_init_anneal_iterations, final_weight=args.aux_loss_weight)
        kappa_bias_l2_loss_weight = bt.get_two_stage_annealed_loss_weight(
            args.kappa_l2_loss_weight, step, total_iterations=num_iterations,
            stage1_iterations=args.kappa_l2_loss_anneal_iterations, stage1_floor_frac=args.kappa_l2_loss_stage1_frac,
            final_floor_frac=args.kappa_l2_loss_final_frac, nolearn_iterations=0)
        kappa_scale_l2_loss_weight = kappa_bias_l2_loss_weight * args.kappa_scale_l2_loss_weight_scale
        moe_U = bt.get_kappa_slope_max_scale(
            args.moe_kappa_slope_max_scale, step, total_iterations=num_iterations,
            warmup_iteration_frac=args.kappa_slope_max_scale_warmup_iteration_frac, delay_iterations=delay)
        dense_U = bt.get_kappa_slope_max_scale(
            args.dense_kappa_slope_max_scale, step, total_iterations=num_iterations,
            warmup_iteration_frac=args.kappa_slope_max_scale_warmup_iteration_frac, delay_iterations=delay)
        model.set_kappa_slope_max_scales(moe_kappa_slope_max_scale=moe_U, dense_kappa_slope_max_scale=dense_U)
        model.set_kappa_bias_ema_rms_reg_step(step)
        kappa_bias_lr_scale = bt.get_kappa_bias_lr_scale(optimizer, step, num_iterations)
        step_losses = None
        for _ in range(grad_accum_steps):
            batch = next(batches)
            loss, micro_losses = model(batch["tokens"], batch["labels"])
            step_losses = bt.accumulate_step_losses(step_losses, micro_losses)
            loss = loss + aux_loss_weight * micro_losses["aux_loss"]
            loss = loss + kappa_bias_l2_loss_weight * micro_losses["kappa_bias_l2_loss"]
            loss = loss + kappa_scale_l2_loss_weight * micro_losses["kappa_scale_l2_loss"]
            loss = loss + kappa_bias_l2_loss_weight * micro_losses["kappa_bias_ema_rms_reg_loss"]
            loss = loss + kappa_scale_l2_loss_weight * micro_losses["kappa_scale_ema_rms_reg_loss"]
            loss = loss / grad_accum_steps
            loss.backward()
            for module in model.modules():  # 4.: fresh dispatch buffers for the next micro-batch
                if isinstance(module, MOELayer):
                    module._expert_inputs_cache = module._expert_router_scores_cache = None
        losses = bt.average_step_losses(step_losses, grad_accum_steps)
        lrm = bt.get_lr_multiplier(step, num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac,
                                   lr_scheduler_skip_iters=args.lr_scheduler_skip_iters,
                                   lr_base_scale=args.lr_base_scale)
        muon_momentum = bt.get_muon_momentum(step)
        kappa_lr = None
        for group in optimizer.param_groups:
            if group.get("name") == "kappa_bias" and group["kind"] == "adamw":
                group["lr"] = group.get("base_lr", group["initial_lr"]) * lrm * kappa_bias_lr_scale
                kappa_lr = group["lr"]
            else:
                group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = muon_momentum
            group["weight_decay"] = bt.get_weight_decay(group["initial_weight_decay"], step, num_iterations)
        model.update_aux_free_load_balancing()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        z = model.config.router_z_loss_weight * losses["router_z_loss"]
        out.append({"ntp_loss": losses["ntp_loss"].item(), "loss": (losses["ntp_loss"] - z).item(),
                    "U": moe_U, "kappa_lr": kappa_lr,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


# ---- weights: the project's names and layouts → 14c9b04's ------------------------------------
def moe_weights(params: dict, ours: str = "", theirs: str = "") -> dict:
    """One κ MoE layer's parameters (under the prefix `ours`) as 14c9b04's MOELayer holds them (under
    `theirs`): fc1's [gate; up] rows split and transposed to gate_proj / c_fc [E, in, out], fc2
    transposed to c_proj, α and b to kappa_scale and kappa_bias."""
    fc1 = params[ours + "experts.fc1_weight"]  # [E, 2F, d]
    ffn = fc1.shape[1] // 2
    return {theirs + "router.w_g.weight": params[ours + "router.weight"],
            theirs + "experts.gate_proj": fc1[:, :ffn].transpose(1, 2),
            theirs + "experts.c_fc": fc1[:, ffn:].transpose(1, 2),
            theirs + "experts.c_proj": params[ours + "experts.fc2_weight"].transpose(1, 2),
            theirs + "experts.kappa_bias": params[ours + "experts.kappa_bias"],
            theirs + "experts.kappa_scale": params[ours + "experts.kappa_alpha"]}


def authors_weights(params: dict, layers: int, heads: int) -> dict:
    """The project's parameters (named_parameters of a one-process nanochat-block model, κ on,
    query groups = heads) under 14c9b04's names and layouts. megatron's fused [q; k; v] rows per
    group, [gate; up] fc1 rows and [E, rows, cols] expert weights are split and transposed to
    c_q/c_k/c_v, gate_proj/c_fc and [E, in, out]; per-layer λ become the [L] vectors. RoPE: megatron
    rotates by +θ, 14c9b04 by −θ (gpt.py 338-344); with D = diag(1, −1) on a head's two halves,
    RoPE₋θ(x) = D·RoPE₊θ(D·x) and D keeps q·k and the q/k norms, so the second half of every head's
    q and k rows is negated and the two models compute the same function."""
    d = params["embedding.word_embeddings.weight"].shape[1]
    head = d // heads
    flip = torch.ones(head)
    flip[head // 2:] = -1
    out = {"transformer.wte.weight": params["embedding.word_embeddings.weight"],
           "lm_head.weight": params["output_layer.weight"],
           "resid_lambdas": torch.cat([params[f"decoder.layers.{i}.resid_lambda"] for i in range(layers)]),
           "x0_lambdas": torch.cat([params[f"decoder.layers.{i}.x0_lambda"] for i in range(layers)])}
    for i in range(layers):
        ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = params[ours + "self_attention.linear_qkv.weight"].view(heads, 3, head, d)
        out[theirs + "attn.c_q.weight"] = (qkv[:, 0] * flip[:, None]).reshape(d, d)
        out[theirs + "attn.c_k.weight"] = (qkv[:, 1] * flip[:, None]).reshape(d, d)
        out[theirs + "attn.c_v.weight"] = qkv[:, 2].reshape(d, d)
        out[theirs + "attn.c_proj.weight"] = params[ours + "self_attention.linear_proj.weight"]
        if ours + "self_attention.value_embedding" in params:
            out[f"value_embeds.{i}.weight"] = params[ours + "self_attention.value_embedding"]
            out[theirs + "attn.ve_gate.weight"] = params[ours + "self_attention.value_gate"]
        if ours + "mlp.router.weight" in params:
            out.update(moe_weights(params, ours + "mlp.", theirs + "mlp."))
        else:
            fc1 = params[ours + "mlp.linear_fc1.weight"]  # [2F, d]
            ffn = fc1.shape[0] // 2
            out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.c_fc.weight"] = fc1[:ffn], fc1[ffn:]
            out[theirs + "mlp.c_proj.weight"] = params[ours + "mlp.linear_fc2.weight"]
    return out


def load_weights(model, weights: dict):
    """Copy `weights` into the authors' model: every parameter but the value-embedding gates of the
    layers without a table (14c9b04 builds one on every layer, unused there; they stay 0)."""
    params = dict(model.named_parameters())
    unused = {n for n in params if n.endswith("ve_gate.weight") and n not in weights}
    assert set(weights) == set(params) - unused, set(params) ^ set(weights)
    assert all(not params[n].any() for n in unused)
    with torch.no_grad():
        for name, value in weights.items():
            assert params[name].shape == value.shape, (name, params[name].shape, value.shape)
            params[name].copy_(value)
