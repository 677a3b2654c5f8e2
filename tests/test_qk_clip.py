"""QK-Clip (train.qk_clip, megatron_kappa.optim.qk_clip) against Kimi K2's rule, computed here.

- the per-head maxima the SDPA core attention records equal a naive float64 loop over the step's
  query/key tensors (GQA head → key-head mapping, causal mask, every micro-batch);
- after the clip, every head's logits on the step's batch (the recorded attention inputs replayed
  through the clipped layers, the logits by a naive loop) are ≤ τ, and the largest of a clipped
  head (GQA: of its group) is τ; the test's weights are scaled up so that several heads exceed τ;
- after a Muon/Aurora/AdamW step at a real learning rate, the clipped weights equal the stepped ones
  times K2's factors computed in float64 (GQA: the group's γ; MLA: q_C γ^α, q_R γ, k_C γ^(1-α));
- ZeRO's fp32 master copy is clipped too: the next step keeps the clip (negative control: without
  the master copy the clip is undone);
- off by default, and a run with it on but never exceeding τ is bit-identical to a run without it
  (negative control: a low τ changes the weights); the GQA rows agree with megatron's helper at TP1;
- under context parallelism the ranks' chunk maxima make the whole sequence's; DP2 (two processes,
  different micro-batches) and CP2 match one process: the maxima are reduced over the
  data-parallel group with CP (slow).
"""
import json
import subprocess

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.parallel.groups import current_device, set_seed

D = torch.float64
COMMON = ["data.mock=true", "model.seq_length=16", "train.micro_batch=2", "train.global_batch=4",
          "train.grad_clip=0", "model.moe.aux_loss=1e-2", "log.tensorboard=false", "train.warmup=1"]
GQA = ["model.qk_layernorm=false", "model.num_query_groups=2"]
MLA = ["model.attention_kind=mla", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=16", "model.mla.qk_head_dim=16",
       "model.mla.qk_pos_emb_head_dim=8", "model.mla.v_head_dim=24"]
KINDS = {"gqa": GQA, "mla": MLA}
SCALE_UP = 6.0  # query/key weights × this: logits × 36, well past the test's τ for most heads


# ---- config ---------------------------------------------------------------------------------
def test_off_by_default():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.train.qk_clip is None
    from megatron_kappa.model.build import transformer_config
    assert transformer_config(cfg).qk_clip is False


@pytest.mark.parametrize("sets,message", [
    (["train.qk_clip=10"], "train.qk_clip: needs model.qk_layernorm false with gqa"),
    (["train.qk_clip=10", "model.qk_layernorm=false", "model.attention=local"],
     "train.qk_clip: needs model.attention sdpa"),
    (["train.qk_clip=0"], "train.qk_clip: must be positive"),
    (["train.qk_clip=10", "model.qk_layernorm=false", "train.qk_clip_alpha=1.0"],
     "train.qk_clip_alpha: must be in (0, 1)")])
def test_refused_in_one_line(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", sets)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mla_with_latent_norms_is_accepted():
    """MLA's norms sit on the latents, before the scaled up-projections."""
    assert load_config("configs/tiny.yaml", MLA + ["train.qk_clip=10"]).model.qk_layernorm


# ---- the naive reference ----------------------------------------------------------------------
def naive_head_max(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[heads] max over b, i, j ≤ i of scale·q_i·k_j in float64; q [s, b, heads, d] and k
    [s, b, groups, d] as megatron hands them to the core attention (head h reads key head
    h // (heads / groups))."""
    s, b, heads, _ = q.shape
    groups = k.shape[2]
    out = torch.full((heads,), float("-inf"), dtype=D)
    for h in range(heads):
        g = h // (heads // groups)
        for i in range(s):
            logits = scale * torch.einsum("bd,jbd->bj", q[i, :, h].to(D), k[: i + 1, :, g].to(D))
            out[h] = max(out[h], logits.max())
    return out


class Recorder:
    """Hooks: every self-attention's input (recorded, or replaced by the recorded one) and its
    core attention's query and key."""

    def __init__(self, model):
        from megatron_kappa.optim.qk_clip import clipped_layers
        self.layers = clipped_layers(model)
        self.inputs, self.qk, self.replay = {}, {}, False
        for i, attn in enumerate(self.layers):
            attn.register_forward_pre_hook(lambda mod, args, i=i: self._input(i, args))
            attn.core_attention.register_forward_pre_hook(lambda mod, args, i=i: self._qk(i, args))

    def _input(self, i, args):
        if self.replay:
            return (self.inputs[i].pop(0).clone(),) + tuple(args[1:])
        self.inputs.setdefault(i, []).append(args[0].detach().clone())

    def _qk(self, i, args):
        self.qk.setdefault(i, []).append((args[0].detach().clone(), args[1].detach().clone()))

    def head_max(self, i) -> torch.Tensor:
        scale = self.layers[i].core_attention.scale
        return torch.stack([naive_head_max(q, k, scale) for q, k in self.qk[i]]).amax(0)


# ---- the engine -------------------------------------------------------------------------------
def engine_for(sets, lr, tau=None, scale_up=SCALE_UP, seed=0):
    """(cfg, model, engine) of tiny + `sets` on DeepSpeed ZeRO in this process, every group at
    learning rate `lr`, the query/key projections × `scale_up`; QK-Clip at τ (`tau`, also None)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.parallel import engine as ds_engine
    clip = [] if tau is None else [f"train.qk_clip={tau}"]
    cfg = load_config("configs/tiny.yaml", COMMON + list(sets) + clip)
    set_seed(seed)  # torch's and megatron's generators (the experts draw from megatron's)
    model = build_model(cfg, current_device())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_qkv.weight", "linear_q_up_proj.weight", "linear_q_proj.weight",
                              "linear_kv_up_proj.weight")):
                p.mul_(scale_up)
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 1,
                                       lambda groups: optim.build_optimizer(groups, cfg.train))
    for group in opt.param_groups:
        group["lr"] = lr
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    return cfg, model, engine


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 2048, (2, 17), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)})
    return out


def step(engine, batch_list):
    """One optimizer step over the micro-batches (gradient accumulation as the loop does it)."""
    from megatron_kappa.train.loop import lm_loss
    pos = torch.arange(16).expand(2, -1)
    engine.train()
    for batch in batch_list:
        engine.backward(lm_loss(engine, batch, pos) / len(batch_list))
    engine.step()


def finish(optimizer_name):
    from megatron_kappa.optim import muon
    if optimizer_name != "adamw":
        muon.uninstall()


# ---- the maxima and the bound ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_recorded_maxima_equal_naive_loop_and_logits_end_at_or_below_tau(world1, kind):
    from megatron_kappa.optim import qk_clip
    from megatron_kappa.train.loop import lm_loss
    cfg, model, engine = engine_for(KINDS[kind] + ["train.optimizer=muon"], lr=0.0, tau=1.0)
    try:
        rec = Recorder(model)
        assert len(rec.layers) == cfg.model.num_layers
        micro = batches(2)
        step(engine, micro)  # lr 0: the weights stay, so the clip alone changes them
        seen = [layer.core_attention.current_max_attn_logits.clone() for layer in rec.layers]
        naive = [rec.head_max(i) for i in range(len(rec.layers))]
        for got, want in zip(seen, naive):
            torch.testing.assert_close(got.to(D), want, rtol=1e-5, atol=1e-6)
        # τ between the heads' maxima: some heads exceed it (the test is built to), some do not
        every = torch.cat(naive)
        tau = float(every.quantile(0.3))
        assert (every > tau).sum() >= len(every) // 2 and (every < tau).any()
        model.config.qk_clip_threshold = tau
        qk_clip.clip(model)
        assert all(layer.core_attention.current_max_attn_logits is None for layer in rec.layers)
        rec.qk, rec.replay = {}, True  # the step's attention inputs through the clipped layers
        pos = torch.arange(16).expand(2, -1)
        with torch.no_grad():
            for batch in micro:
                lm_loss(model, batch, pos)
        for i, before in enumerate(naive):
            after = rec.head_max(i)
            assert (after <= tau * (1 + 1e-5)).all(), (i, after, tau)
            if kind == "mla":  # per head: a clipped head's largest logit lands on τ, the others stay
                want = torch.where(before > tau, torch.full_like(before, tau), before)
            else:  # per group: the group's largest lands on τ, every logit of the group × the same γ
                group = before.view(2, -1).amax(1, keepdim=True)
                want = (before.view(2, -1) * torch.where(group > tau, tau / group, 1.0)).reshape(-1)
            torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-6)
    finally:
        finish("muon")


def test_context_parallel_chunks_give_the_whole_sequences_maxima():
    """Under parallel.cp each rank records its query chunks against the keys they see
    (SDPAttention.observe_chunk); the MAX over the CP ranks is the whole sequence's, per head
    (GQA), here with the ranks simulated as iterations. Negative control: the chunks' keys
    without their mask see later tokens and give larger maxima."""
    from megatron_kappa.model.attention import head_max_logits
    from megatron_kappa.model.cp_attention import context_parallel_attention
    from tests.support.context_parallel_reference import sequence_positions
    S, B, HEADS, GROUPS, HD, scale = 24, 2, 4, 2, 8, 8 ** -0.5
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, n, HD, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    k[S - 1, :, 0] = 3 * q[0, :, 0]  # the largest logit of head 0 where causal attention forbids it
    whole = naive_head_max(q, k, scale)
    for cp in (2, 4):
        masked, unmasked = [], []
        for rank in range(cp):
            mine = sequence_positions(rank, cp, S)
            every = torch.cat([torch.cat([k, v], -1)[sequence_positions(r, cp, S)] for r in range(cp)])
            context_parallel_attention(
                q[mine], k[mine], v[mine], rank=rank, size=cp, scale=scale, gather=lambda t, every=every: every,
                enable_gqa=True, observe=lambda q_, k_, mask: (masked.append(head_max_logits(q_, k_, scale, False,
                                                                                             mask)),
                                                               unmasked.append(head_max_logits(q_, k_, scale, False))))
        torch.testing.assert_close(torch.stack(masked).amax(0).to(D), whole, rtol=1e-6, atol=1e-6)
        assert (torch.stack(unmasked).amax(0).to(D) > whole + 1e-4).any()


# ---- the factors, in float64 ------------------------------------------------------------------
def k2_factors(name, W, S, tau, alpha, cfg):
    """Kimi K2's factor for each element of weight `name` (float64), from the heads' maxima S."""
    gamma = torch.where(S > tau, tau / S, torch.ones_like(S))
    m = cfg.model
    if name.endswith("linear_qkv.weight"):  # GQA: per group [q of r heads, k, v]
        groups = m.num_query_groups
        d = m.hidden_size // m.num_attention_heads
        r = m.num_attention_heads // groups
        g = torch.where(S.view(groups, r).amax(1) > tau, tau / S.view(groups, r).amax(1), torch.ones(groups, dtype=D))
        rows = torch.cat([torch.cat([g[j].pow(alpha).expand(r * d), g[j].pow(1 - alpha).expand(d),
                                     torch.ones(d, dtype=D)]) for j in range(groups)])
    elif name.endswith(("linear_q_up_proj.weight", "linear_q_proj.weight")):  # per head [q_C, q_R]
        a = m.mla
        rows = torch.cat([torch.cat([gamma[h].pow(alpha).expand(a.qk_head_dim), gamma[h].expand(a.qk_pos_emb_head_dim)])
                          for h in range(len(S))])
    elif name.endswith("linear_kv_up_proj.weight"):  # per head [k_C, v]
        a = m.mla
        rows = torch.cat([torch.cat([gamma[h].pow(1 - alpha).expand(a.qk_head_dim), torch.ones(a.v_head_dim, dtype=D)])
                          for h in range(len(S))])
    else:
        return torch.ones_like(W, dtype=D)
    return rows[:, None].expand(W.shape)


@pytest.mark.parametrize("kind,optimizer", [("gqa", "muon"), ("mla", "aurora"), ("gqa", "adamw")])
def test_clip_equals_k2_formula_in_float64_after_a_real_step(world1, kind, optimizer):
    from deepspeed.utils import safe_get_full_fp32_param

    from megatron_kappa.optim import qk_clip
    alpha = 0.5
    cfg, model, engine = engine_for(KINDS[kind] + [f"train.optimizer={optimizer}"], lr=0.02, tau=1.0)
    try:
        rec = Recorder(model)
        step(engine, batches(2))
        S = {i: rec.head_max(i) for i in range(len(rec.layers))}
        tau = float(torch.cat(list(S.values())).quantile(0.4))  # between the heads' maxima
        model.config.qk_clip_threshold = tau
        assert all((s > tau).any() for s in S.values())  # every layer has a head to clip
        stepped = {n: p.detach().to(D).clone() for n, p in model.named_parameters()}
        qk_clip.clip(model)
        layer_of = {id(p): i for i, layer in enumerate(rec.layers) for p in layer.parameters()}
        changed = 0
        for name, p in model.named_parameters():
            if id(p) not in layer_of:
                assert torch.equal(p.detach().to(D), stepped[name]), name
                continue
            want = stepped[name] * k2_factors(name, p, S[layer_of[id(p)]], tau, alpha, cfg)
            torch.testing.assert_close(p.detach().to(D), want, rtol=2e-6, atol=1e-9)
            # ZeRO's fp32 master copy holds the clipped weight too
            assert torch.equal(safe_get_full_fp32_param(p), p.detach().float()), name
            changed += not torch.equal(p.detach().to(D), stepped[name])
        assert changed >= cfg.model.num_layers  # at least one weight per layer was clipped
    finally:
        finish(optimizer)


# ---- the master copy ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep_master", [True, False], ids=["clipped", "negative-control-master-untouched"])
def test_next_step_keeps_the_clip(world1, monkeypatch, keep_master):
    """At learning rate 0 the next step writes ZeRO's master copy back into the weights unchanged:
    the clip stays only because the master copy was clipped too (ZeRO-2 here, ZeRO-1 above)."""
    from megatron_kappa.optim import qk_clip
    if not keep_master:
        monkeypatch.setattr(qk_clip, "scale_master", lambda param, factor: None)
    cfg, model, engine = engine_for(GQA + ["train.optimizer=aurora", "zero.stage=2"], lr=0.0, tau=1.0)
    try:
        micro = batches(1)
        step(engine, micro)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        qk_clip.clip(model)
        clipped = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert sum(not torch.equal(before[n], clipped[n]) for n in before) == cfg.model.num_layers
        step(engine, micro)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(torch.equal(after[n], (clipped if keep_master else before)[n]) for n in after)
    finally:
        finish("aurora")


# ---- off: bit-identical ------------------------------------------------------------------------
def train_steps(sets, tau, steps=3):
    from megatron_kappa.optim import qk_clip
    cfg, model, engine = engine_for(GQA + list(sets), lr=0.01, tau=tau, scale_up=SCALE_UP)
    try:
        for i in range(steps):
            step(engine, batches(2, seed=10 + i))
            if cfg.train.qk_clip is not None:  # as the loop calls it
                qk_clip.clip(model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, model
    finally:
        finish(cfg.train.optimizer)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_on_but_never_above_tau_is_bit_identical_to_off(world1, optimizer):
    off, model = train_steps([f"train.optimizer={optimizer}"], None)
    assert not model.config.qk_clip
    assert all(getattr(m, "current_max_attn_logits", None) is None for m in model.modules())  # nothing recorded
    never, _ = train_steps([f"train.optimizer={optimizer}"], 1e30)
    low, _ = train_steps([f"train.optimizer={optimizer}"], 1.0)
    assert all(torch.equal(off[n], never[n]) for n in off)
    assert any(not torch.equal(off[n], low[n]) for n in off)  # negative control: a clip that acts is seen


def test_gqa_rows_agree_with_megatron_at_tp1(world1):
    """megatron's _clip_linear_qkv (global sizes, right at TP1) gives the same factors."""
    from megatron_kappa.optim import qk_clip
    cfg, model, engine = engine_for(GQA, lr=0.0, tau=1.0)
    attn = qk_clip.clipped_layers(model)[0]
    S = torch.tensor([0.5, 3.0, 1.5, 0.9])
    mine = qk_clip.gqa_multiplier(attn, S)[attn.linear_qkv.weight]
    attn.qk_clip_balancing_eta = qk_clip.gamma(S.view(2, -1).amax(1), 1.0).view(2, 1, 1)
    theirs = attn._clip_linear_qkv(torch.ones(attn.linear_qkv.weight.shape))
    assert torch.equal(mine, theirs) and not torch.equal(mine, torch.ones_like(mine))


def test_gamma_leaves_negative_and_nonfinite_maxima_alone():
    from megatron_kappa.optim.qk_clip import gamma
    S = torch.tensor([-5.0, 0.5, 1.0, 4.0, float("nan"), float("inf")])
    assert gamma(S, 1.0).tolist() == [1.0, 1.0, 1.0, 0.25, 1.0, 1.0]


# ---- two processes -----------------------------------------------------------------------------
DP = COMMON + GQA + ["train.steps=4", "log.interval=1", "checkpoint.interval=100", "eval.valid_every=0",
                     "model.seq_length=32", "train.optimizer=muon", "train.qk_clip=1.0", "model.init_std=0.1"]


@pytest.mark.slow
def test_data_parallel_maxima_are_reduced(world1, tmp_path):
    """DP2 (each rank its own micro-batch) and CP2 (each rank two chunks of every sequence) against
    one process: the same losses and logged maxima only when the clip uses the maxima of both
    ranks (negative control: DP2 with each rank's own)."""
    from megatron_kappa.train.loop import run
    from tests.support.processes import ROOT, deepspeed_cmd, env, free_port, records
    from tests.support.weights import save_init_weights
    init = save_init_weights(tmp_path / "init.pt", DP)
    runs = {name: tmp_path / name for name in ("one", "dp2", "local", "cp2")}
    def sets(name):
        return DP + [f"run.dir={runs[name]}", f"train.init_weights={init}"]
    run(load_config("configs/tiny.yaml", sets("one")), log=lambda *a: None)
    plan = [{"overrides": sets("dp2")}, {"overrides": sets("local"), "local_max": True},
            {"overrides": sets("cp2") + ["parallel.cp=2"]}]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run(deepspeed_cmd(ROOT / "tests/support/qk_clip_worker.py", str(tmp_path / "plan.json"),
                                        port=free_port()),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, dp2, local, cp2 = (records(runs[name]) for name in ("one", "dp2", "local", "cp2"))
    assert len(one) == 4 and all(r["max_attention_logit"] > 1.0 for r in one)  # it clips every step
    for key in ("loss", "max_attention_logit"):  # CP2: each rank its sequences' two chunks
        assert max(abs(a[key] - b[key]) for a, b in zip(one, dp2)) <= 1e-5, key
        assert max(abs(a[key] - b[key]) for a, b in zip(one, cp2)) <= 1e-5, key
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, local)) > 1e-5
