"""The layouts and memory settings the published frontier runs trained with, each with its source:
`python -m plan --published` plans each one (does it fit?) and ranks it among the
layouts `--search` finds at its world size. docs/plan.md has the table.

What a row cannot express is said in its `note`, and anything the report does not give
(micro-batch sizes) is an assumption named there. Where a report says the run used virtual
stages but not how many (Kimi K2), the row leaves the number open (`open_vpp`) and the planner
takes the fastest that fits, as `--search` picks a layout's micro-batch.
"""
from __future__ import annotations

import dataclasses

from megatron_kappa.config import load_config
from plan.estimate import plan
from plan.layout import Layout, model_shape
from plan.planned import Planned
from plan.search import divisors, rank_of, search
from plan.speed import Rates

H800 = Rates(nvlink_gbs=160.0, ib_gbs=50.0)  # DeepSeek-V3 §3.2.2: NVLink 160 GB/s, InfiniBand 50 GB/s per GPU


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    config: str
    layout: Layout
    sets: tuple[str, ...]  # the run's batch, precision, recompute and stage split as config overrides
    planned: Planned
    rates: Rates
    source: str
    note: str = ""
    measured_s: float | None = None  # the step time the source measured, where it gives one
    measured_tflops: float | None = None  # where it gives only megatron's model TFLOP/s per GPU (measured_seconds)
    measured_tokens_per_gpu_s: float | None = None  # where it gives only tokens per second per GPU
    open_vpp: bool = False  # virtual stages, their number not given: the fastest that fits (chosen_vpp)
    imbalance: float = 1.0  # the busiest EP rank's routed rows over the average as planned (1: forced balance)


def run_settings(**planned) -> Planned:
    """A published run's planned-only settings: each also ran a fused SwiGLU (NVIDIA's recipes set
    bias_activation_fusion, Megatron-LM's default; DeepSeek's and Moonshot's own kernels), which
    this trainer does not (Planned.fused_swiglu)."""
    return Planned(fused_swiglu=True, **planned)


RUNS = (
    Published(
        "DeepSeek-V3", "configs/frontier/deepseek_v3.yaml", Layout(2048, tp=1, pp=16, ep=64, etp=1),
        ("precision=fp8", "model.recompute=selective", "model.recompute_modules=[mla_up_proj,moe_act]",
         "train.micro_batch=1", "train.global_batch=15360"),
        run_settings(optimizer_states="bf16", fp8_activations="linear+moe", recompute_norms=True,
                     overlap=("expert", "pipeline"), node_dispatch=True, dualpipe=True), H800,
        "DeepSeek-V3 Technical Report, arXiv:2412.19437: §3.2 (2,048 H800 GPUs, PP16, EP64 over 8 nodes, "
        "ZeRO-1 DP, no TP), §3.2.3 (RMSNorm and MLA up-projections recomputed), §3.3 (FP8 GEMMs, "
        "AdamW moments in BF16, master weights FP32), §3.3.3 (linear layers' inputs cached in FP8; the "
        "MoE SwiGLU's input cached in FP8 and its output recomputed), §3.2.1 (DualPipe: two copies of "
        "the parameters, the all-to-all and the pipeline's sends hidden behind computation), §3.2.2 (a "
        "token reaches at most 4 nodes, crossing to each once over InfiniBand, then NVLink), §4.2 (4K "
        "sequences, batch 15,360)",
        "micro-batch 1 assumed; the attention output's E5M6 (1.5 bytes) planned as FP8"),
    Published(
        "Kimi K2", "configs/frontier/kimi_k2.yaml", Layout(256, tp=1, pp=16, ep=16, etp=1),
        ("model.recompute=selective", "model.recompute_modules=[mla_up_proj,moe_act]", "train.optimizer=muon",
         "train.micro_batch=1", "train.global_batch=16384"),
        run_settings(fp8_activations="moe", recompute_norms=True, offload_optimizer=True,
                     offload_activations=True, overlap=("expert", "pipeline")),
        H800,
        "Kimi K2 Technical Report, arXiv:2507.20534, §2.4 (H800 GPUs; PP16 with virtual stages, EP16, "
        "ZeRO-1; a 256-GPU model-parallel group, optimizer states offloaded to the CPU at 32 nodes; "
        "LayerNorm, SwiGLU and MLA up-projections recomputed, the MoE up-projections' and SwiGLU's "
        "inputs kept in FP8, the other activations offloaded to the CPU; EP all-to-all and PP "
        "communication overlapped with computation under interleaved 1F1B, Figure 7), MuonClip, "
        "4,096-token sequences, 67 M tokens per batch",
        "32 nodes (the smallest the report names); the number of virtual stages the planner's (the "
        "report gives none); micro-batch 1 assumed", open_vpp=True),
    Published(
        "Qwen3-235B-A22B", "configs/frontier/qwen3_235b_a22b.yaml", Layout(128, tp=4, pp=16, ep=8, etp=1, cp=2),
        ("parallel.first_stage_layers=5", "parallel.last_stage_layers=5", "model.recompute=none",
         "train.micro_batch=1", "train.global_batch=32"),
        run_settings(overlap=("data",)), Rates(),
        "Megatron-Bridge recipes/qwen/qwen3_235b_a22b.py (commit 3594df9): 16 nodes × 8 GPUs, TP4 PP16 "
        "CP2 EP8 ETP1 with sequence parallelism, embedding and loss counted in the stage split, "
        "micro-batch 1, global batch 32, 4,096 tokens, bf16, the distributed optimizer",
        "no recompute set in the recipe; its DistributedDataParallelConfig overlaps the gradient "
        "reduce and the parameter gather (overlap_grad_reduce, overlap_param_gather)"),
    Published(
        "Mixtral-8x22B", "configs/frontier/mixtral_8x22b.yaml", Layout(128, tp=2, pp=4, ep=8, etp=2, cp=2, vpp=14),
        ("model.recompute=none", "train.micro_batch=1", "train.global_batch=512"),
        run_settings(overlap=("data", "pipeline")), Rates(),
        "NeMo recipes/mixtral_8x22b.py (commit 00138e2): 16 nodes × 8 GPUs, TP2 PP4 VPP14 CP2 EP8 with "
        "sequence parallelism (expert TP = TP, megatron's default), micro-batch 1, global batch 512, "
        "4,096 tokens, bf16, the distributed optimizer",
        "no recompute set in the recipe; its DistributedDataParallelConfig overlaps the gradient "
        "reduce and the parameter gather (overlap_grad_reduce, overlap_param_gather); the stage-to-stage "
        "sends' overlap assumed as NVIDIA's Mixtral examples set it (NeMo-Framework-Launcher "
        "examples/training/mixtral/h100/mixtral_8x7b_bf16.sh: overlap_p2p_comm)"),
)

# NVIDIA's throughput-tuned layouts for the same models, with the step times they measured on H100
# (80 GB, 8 per node, InfiniBand 8 × 50 GB/s per node): Megatron-MoE-ModelZoo at e865051
# (github.com/yanring/Megatron-MoE-ModelZoo). Qwen3's 94 layers with the embedding and the loss
# each counted as a layer in the split (--account-for-embedding/loss-in-pipeline-split): 32 chunks
# of 3. bf16 runs add --tp-comm-overlap, every model config sets overlap_grad_reduce and
# overlap_param_gather, megatron overlaps the interleaved schedule's sends by default, and A2A_OVERLAP
# adds --overlap-moe-expert-parallel-comm (sbatch_benchmarking.sh:95, :115); DeepEP is the flex
# dispatcher (node-limited sends).
ZOO = "Megatron-MoE-ModelZoo e865051 "
QWEN3_SPLIT = "Ett|" + "ttt|" * 30 + "ttL"
QWEN3_TUNED = ("parallel.first_stage_layers=null", "parallel.last_stage_layers=null", f"parallel.layout={QWEN3_SPLIT}",
               "train.micro_batch=1", "train.global_batch=2048")
TUNED = (
    Published(
        "Qwen3-235B-A22B (NVIDIA, H100)", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=2, pp=8, ep=32, etp=1, vpp=4),
        (*QWEN3_TUNED, "parallel.vpp=4", "model.recompute=selective", "model.recompute_modules=[moe_act]"),
        run_settings(recompute_norms=True, overlap=("data", "tensor", "pipeline"),
                     node_dispatch=True), Rates(),
        ZOO + "best_practice/qwen3/readme.md:14 (DeepEP, norm and act recomputed, GBS 2048, MBS 1)",
        measured_s=19.7),
    Published(
        "Qwen3-235B-A22B (NVIDIA, H100, all-to-all overlapped)", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=2, pp=8, ep=32, etp=1, vpp=4),
        (*QWEN3_TUNED, "parallel.vpp=4", "model.recompute=selective", "model.recompute_modules=[moe_act]"),
        run_settings(recompute_norms=True, overlap=("data", "tensor", "pipeline", "expert"),
                     node_dispatch=True), Rates(),
        ZOO + "best_practice/qwen3/readme.md:15 (the same, +1F1B A2A overlap); run_h100_235b.sh",
        measured_s=17.6),
    Published(
        "Qwen3-235B-A22B (NVIDIA, H100, TP4 EP8)", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=4, pp=8, ep=8, etp=1, vpp=4),
        (*QWEN3_TUNED, "parallel.vpp=4", "model.recompute=none"),
        run_settings(overlap=("data", "tensor", "pipeline"), node_dispatch=True), Rates(),
        ZOO + "best_practice/qwen3/readme.md:19 (DeepEP, no recompute, GBS 2048, MBS 1)",
        measured_s=29.0),
    Published(
        "Mixtral-8x22B (NVIDIA, H100)", "configs/frontier/mixtral_8x22b.yaml",
        Layout(128, tp=2, pp=8, ep=8, etp=1, vpp=7),
        ("parallel.vpp=7", "model.recompute=none", "train.micro_batch=1", "train.global_batch=256"),
        run_settings(overlap=("data", "tensor", "pipeline")), Rates(),
        ZOO + "runtime_configs/benchmarking/runtime.conf:8 and best_practice/mixtral/run_mixtral_8x22B.sh:27-31 "
        "(16 nodes, TP2 PP8 VPP7 EP8, all-to-all dispatcher, GBS 256, MBS 1; about 445 TFLOP/s per GPU "
        "dropless, 465 with forced balance)",
        measured_tflops=465),
)


# The same layout as TUNED's TP4 EP8 row (PP8 VPP4, DeepEP, 32 nodes of H100) at 16K to 128K tokens,
# where the source gives megatron's model TFLOP/s per GPU, not step times (measured_seconds reads them
# as step times): ModelZoo best_practice/qwen3/readme.md:33-38 and its command at :43 (global batch
# 256, selective recompute of megatron's layernorm and moe modules, no all-to-all overlap). The
# forced-balance figures: the planner's experts are balanced (dropless with real routing: 237, 277,
# 320 and 357). TE's ring attention sends the next K/V chunk while it computes on this one (context
# overlapped); bf16 runs add --tp-comm-overlap as above.
LONG_CONTEXT = tuple(
    Published(
        f"Qwen3-235B-A22B (NVIDIA, H100, {seq // 1024}K tokens, CP{cp})", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=4, pp=8, ep=8, etp=1, cp=cp, vpp=4),
        (*QWEN3_TUNED[:-1], "train.global_batch=256", f"model.seq_length={seq}", "parallel.vpp=4",
         "model.recompute=selective", "model.recompute_modules=[moe]"),
        run_settings(recompute_norms=True, overlap=("data", "tensor", "pipeline", "context"),
                     node_dispatch=True), Rates(),
        ZOO + f"best_practice/qwen3/readme.md:{line} ({seq:,} tokens, TP4 CP{cp}, GBS 256, {tflops} TFLOP/s "
        "forced balance)",
        measured_tflops=tflops)
    for seq, cp, tflops, line in ((16384, 1, 295, 35), (32768, 2, 335, 36), (65536, 4, 368, 37), (131072, 8, 389, 38)))

# The same four runs with dropless routing (the readme's second figures, 237 to 357 TFLOP/s): the
# experts' load as routed, not forced even. Planned with one expert-imbalance margin (the busiest
# EP rank's routed rows over the average) fitted so that the estimate's dropless/forced step ratio
# at 16K equals the measured one (1.245; bench/plan_published_measured.py refits and prints it);
# the other three lengths then test the margin's reach: where attention's share of the step grows
# with the length, the experts' imbalance costs less (1.21, 1.15, 1.09 measured).
DROPLESS_IMBALANCE = 1.53
DROPLESS_TFLOPS = {16384: 237, 32768: 277, 65536: 320, 131072: 357}
MIXTRAL_DROPLESS_TFLOPS = 445  # TUNED's Mixtral row, dropless (its source): the margin is the model's and router's
LONG_CONTEXT_DROPLESS = tuple(
    dataclasses.replace(
        run, name=run.name.replace(" tokens,", " tokens, dropless,"), imbalance=DROPLESS_IMBALANCE,
        source=run.source.replace(f"{run.measured_tflops} TFLOP/s forced balance", f"{tflops} TFLOP/s dropless"),
        measured_tflops=tflops)
    for run, tflops in zip(LONG_CONTEXT, DROPLESS_TFLOPS.values()))


# Other runs NVIDIA measured on H100s (80 GB, 8 per node), planned to set the estimate beside them;
# not searched (--published --rank searches TUNED's). ModelZoo's fourth H100 row: its 94 layers and
# the embedding and the loss one to a chunk, so the first chunk holds the embedding alone and the
# last the loss alone (a stage the trainer refuses and the planner plans). Megatron-Bridge's
# performance summary (docs/performance-summary.md at 00b7660, the 25.11 H100 table, and
# performance-summary-archive.md at 0a25f91, the 26.02 and 25.09 H100 tables) gives tokens per
# second per GPU for its performance presets: scripts/performance/configs/qwen/
# qwen3_workload_base_configs.py at 01b2977 (QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V1/V2:
# TP2 PP8 VPP4 EP32, the all-to-all dispatcher with its overlap) and qwen3_llm_pretrain.py at
# 05c0c90 (no recompute, no TP overlap, forced balance); deepseek/deepseek_workload_base_configs.py
# at 0426418 (DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1: TP2 PP8 VPP4 EP64, MLA up-projections and the
# dense MLPs recomputed, HybridEP, no all-to-all overlap) and deepseek_llm_pretrain.py (layout
# Et|(tt|)*30mL, gradient-reduce overlap off, forced balance). FP8 current scaling for both.
ZOO_PP32_SPLIT = "E|" + "t|" * 94 + "L"
MEASURED = (
    Published(
        "Qwen3-235B-A22B (NVIDIA, H100, TP2 PP32 EP8)", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=2, pp=32, ep=8, etp=1, vpp=3),
        ("parallel.first_stage_layers=null", "parallel.last_stage_layers=null", f"parallel.layout={ZOO_PP32_SPLIT}",
         "train.micro_batch=1", "train.global_batch=2048", "parallel.vpp=3", "model.recompute=selective",
         "model.recompute_modules=[moe_act]"),
        run_settings(recompute_norms=True, overlap=("data", "tensor", "pipeline")), Rates(),
        ZOO + "best_practice/qwen3/readme.md:18 (all-to-all dispatcher, norm and act recomputed, GBS 2048, MBS 1)",
        measured_s=24.2),
    *(Published(
        f"Qwen3-235B-A22B (NVIDIA, H100, FP8, batch {batch:,})", "configs/frontier/qwen3_235b_a22b.yaml",
        Layout(256, tp=2, pp=8, ep=32, etp=1, vpp=4),
        (*QWEN3_TUNED[:-1], f"train.global_batch={batch}", "parallel.vpp=4", "model.recompute=none", "precision=fp8"),
        run_settings(overlap=("data", "pipeline", "expert")), Rates(),
        f"Megatron-Bridge docs/{page} ({release}, DGX-H100: {tokens:,} tokens/s per GPU); "
        f"QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_{preset}",
        measured_tokens_per_gpu_s=tokens)
      for batch, page, release, tokens, preset in ((2048, "performance-summary.md", "25.11", 1575, "V1"),
                                                   (8192, "performance-summary-archive.md", "26.02", 1633, "V2"))),
    Published(
        "DeepSeek-V3 (NVIDIA, H100, FP8)", "configs/frontier/deepseek_v3.yaml",
        Layout(1024, tp=2, pp=8, ep=64, etp=1, vpp=4),
        ("parallel.first_stage_layers=null", "parallel.last_stage_layers=null", "parallel.layout=Et|(tt|)*30mL",
         "parallel.vpp=4", "precision=fp8", "model.recompute=selective", "model.recompute_modules=[mla_up_proj,mlp]",
         "train.micro_batch=1", "train.global_batch=8192"),
        run_settings(overlap=("pipeline",), node_dispatch=True), Rates(),
        "Megatron-Bridge docs/performance-summary-archive.md (25.09, DGX-H100, dropless: 1,297 tokens/s per "
        "GPU); DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1",
        measured_tokens_per_gpu_s=1297),
    Published(
        "Mixtral-8x22B (NVIDIA, H100, FP8)", "configs/frontier/mixtral_8x22b.yaml",
        Layout(128, tp=2, pp=8, ep=8, etp=1, vpp=7),
        ("parallel.vpp=7", "model.recompute=none", "train.micro_batch=1", "train.global_batch=256", "precision=fp8"),
        run_settings(optimizer_states="bf16", overlap=("data", "pipeline")), Rates(),
        ZOO + "best_practice/mixtral/run_mixtral_8x22B.sh:33-34 (TUNED's Mixtral layout in block-wise FP8, forced "
        "balance: about 560 TFLOP/s per GPU) and sbatch_benchmarking.sh:84-96 (bf16 moments, no TP overlap in fp8)",
        measured_tflops=560),
    *LONG_CONTEXT,
)


def megatron_model_flops(cfg) -> float:
    """One sequence's training FLOPs as megatron-lm counts them for the TFLOP/s per GPU it logs
    (NVIDIA/Megatron-LM megatron/training/training.py at 001b00c, num_floating_point_operations,
    its transformer_flops): 3 passes (forward, data and weight gradients) × 2 per multiply-add
    over the q/k/v and output projections, QKᵀ and AV over the causal half, dense MLPs, the top-k
    routed and the shared experts (SwiGLU's 3 matrices), and the logits over the vocabulary padded
    to 128 × TP; no router, norms or recompute. GQA and multi-head attention, no MTP."""
    from megatron_kappa.model.layout import model_layout, padded_vocab_size
    m = cfg.model
    if m.mla.enabled or m.mtp.num_layers:
        raise ValueError("model.mla / model.mtp: megatron_model_flops counts GQA attention without MTP only")
    h, s, n = m.hidden_size, m.seq_length, m.num_attention_heads
    d = m.head_dim or h // n
    q, kv = n * d, (m.num_query_groups or n) * d
    attention = h * (q + 2 * kv) + q * s / 2 * 2 + q * h
    moe_layers = model_layout(cfg).num_moe_layers
    dense_layers = m.num_layers - moe_layers
    moe = m.moe
    mlp = 3 * h * ((m.ffn_hidden_size or 4 * h) * dense_layers
                   + ((moe.ffn_hidden_size or m.ffn_hidden_size) * moe.topk + (moe.shared_ffn_hidden_size or 0))
                   * moe_layers)
    return s * 3 * 2 * (mlp + attention * m.num_layers + h * padded_vocab_size(cfg))


def measured_seconds(run: Published) -> float | None:
    """The step time the source measured: given, or read from its tokens per second per GPU (a
    step's tokens over all the run's GPUs' rate), or from megatron's model TFLOP/s per GPU (a
    step's megatron_model_flops over the rate of all the run's GPUs)."""
    if run.measured_s or not (run.measured_tflops or run.measured_tokens_per_gpu_s):
        return run.measured_s
    cfg = config_of(run)
    if run.measured_tokens_per_gpu_s:
        return cfg.train.global_batch * cfg.model.seq_length / (run.measured_tokens_per_gpu_s * run.layout.world)
    return cfg.train.global_batch * megatron_model_flops(cfg) / (run.measured_tflops * 1e12 * run.layout.world)


def config_of(run: Published):
    """The run's config: its layout and settings, with plain SwiGLU experts (the published runs
    had no κ, and so none of its α and b parameters)."""
    par = run.layout
    return load_config(run.config, [*run.sets, "model.kappa.enabled=false", f"parallel.tp={par.tp}",
                                    f"parallel.pp={par.pp}", f"parallel.ep={par.ep}", f"parallel.etp={par.etp}"])


def chosen_vpp(run: Published, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8) -> Published:
    """`run` with its virtual stages: as given, or (open_vpp) the number above 1 that divides its
    largest stage's layers (as --search tries them) and is fastest among those that fit (the
    first tried, 2 where it divides, when none fits: the verdict then says so)."""
    if not run.open_vpp:
        return run
    cfg = config_of(run)
    most = max(model_shape(cfg, run.layout).stage_counts())
    tried = [dataclasses.replace(run.layout, vpp=v) for v in divisors(most) if v > 1]
    plans = [(layout, plan(cfg, layout, gpu_mem_gib, gpus_per_node, run.rates, run.imbalance, run.planned))
             for layout in tried]
    fitting = [(layout, p) for layout, p in plans if p["fits"]] or plans[:1]
    best = max(fitting, key=lambda lp: lp[1]["speed"]["tokens_per_s"])[0]
    return dataclasses.replace(run, layout=best)


def check_run(run: Published, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8, ranked: bool = True,
              progress: bool = False) -> dict:
    """The plan of a published run (its virtual stages chosen where the source gives no number:
    chosen_vpp), and (`ranked`) its position among --search's layouts that fit at its world size
    with its planned-only settings (`progress`: the search's bar on stderr)."""
    run = chosen_vpp(run, gpu_mem_gib, gpus_per_node)
    cfg = config_of(run)
    p = plan(cfg, run.layout, gpu_mem_gib, gpus_per_node, run.rates, run.imbalance, run.planned)
    out = {"name": run.name, "plan": p, "fits": p["fits"], "gib": p["most_loaded"]["total_bytes"] / 2 ** 30,
           "layout": run.layout}
    if ranked:
        rows = search(cfg, run.layout.world, gpu_mem_gib, gpus_per_node, None, run.rates, run.imbalance,
                      planned=run.planned, progress=progress)
        own = p["speed"]["tokens_per_s"]
        # by_speed: where the run's own estimate falls among the searched layouts' best ones (also
        # for a stage split the search does not try, such as an uneven split with virtual stages)
        out.update(rank=rank_of(rows, run.layout), layouts_that_fit=len(rows),
                   by_speed=1 + sum(r["speed"]["tokens_per_s"] > own for r in rows),
                   of_first=own / rows[0]["speed"]["tokens_per_s"] if rows else None)
    return out
