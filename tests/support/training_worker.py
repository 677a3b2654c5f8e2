"""Runs several trainings in one multi-process launch (the imports dominate on CPU):

    deepspeed --num_gpus 2 tests/support/training_worker.py PLAN.json

PLAN is a list of {"overrides": [...], "negative": null | "unmarked_experts" | "zero2_pipeline" |
"x0_not_sent_back" | "embedding_copy_unsynced" | "batched_p2p" | "mtp_stage_skips" |
"cp_positions_not_offset" | "cp_unbalanced_split" | "alpha_per_shard", "log": false,
"report_offload": false}; each
entry is a full `megatron_kappa.train.run` of configs/tiny.yaml with those overrides ("log": print
"== case <i>" and the run's log lines; "report_offload": print "== cpu_offload <flag>", DeepSpeed's
own flag for its ZeRO-Offload path, from the optimizer the engine built).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_kappa.config import load_config
from megatron_kappa.parallel import engine, groups
from megatron_kappa.parallel.launch_env import exit_process
from megatron_kappa.train import loop


def unmarked(original):
    """Negative control: experts look like dense parameters to DeepSpeed (no marking at all)."""
    def wire(model):
        for p in model.parameters():
            p.allreduce = True
        return False
    return wire


def context_parallel_negative(negative):
    """The context-parallel negative controls, applied; returns what undoes them.
    cp_positions_not_offset: RoPE gives every rank positions 0..s/CP instead of its chunks' (megatron's
    get_pos_emb_on_this_cp_rank takes the first tokens); cp_unbalanced_split: rank r reads the r-th
    contiguous piece of each sequence where RoPE and the attention expect megatron's chunks r and
    2·CP−1−r."""
    import importlib

    from megatron_kappa.parallel import compat, context
    compat.apply("cpu")  # first: its own RoPE patch would replace the negative control's
    rope = [importlib.import_module(f"megatron.core.models.common.embeddings.{m}")
            for m in ("rope_utils", "rotary_pos_embedding")]
    saved = [m.get_pos_emb_on_this_cp_rank for m in rope], context.get_batch_on_this_cp_rank
    if negative == "cp_positions_not_offset":
        for m in rope:
            m.get_pos_emb_on_this_cp_rank = lambda emb, dim, group: emb.narrow(dim, 0, emb.shape[dim] // group.size())
    if negative == "cp_unbalanced_split":
        def contiguous(batch, is_hybrid_cp, cp_group):
            rank, size = cp_group.rank(), cp_group.size()
            return {k: v.chunk(size, dim=1)[rank] for k, v in batch.items()}
        context.get_batch_on_this_cp_rank = contiguous

    def undo():
        for m, f in zip(rope, saved[0]):
            m.get_pos_emb_on_this_cp_rank = f
        context.get_batch_on_this_cp_rank = saved[1]
    return undo


def main(plan_path):
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    plan = json.loads(Path(args[0]).read_text())
    wire = engine.wire_experts
    for i, case in enumerate(plan):
        engine.wire_experts = unmarked(wire) if case.get("negative") == "unmarked_experts" else wire
        if case.get("log"):  # the run's log lines on stdout, after a header naming the case
            print(f"== case {i}", flush=True)
        log = (lambda *a, **k: print(*a, flush=True)) if case.get("log") else (lambda *a, **k: None)
        if case.get("negative") == "x0_not_sent_back":
            # negative control: a later stage's x0 detached, so its gradient never reaches the embedding
            from megatron_kappa.model import nanochat
            set_input = nanochat.NanochatGPTModel.set_input_tensor

            def detached(self, tensor, set_input=set_input):
                set_input(self, tensor)
                if self.inputs.x0 is not None and not self.pre_process:
                    self.inputs.x0 = self.inputs.x0.detach()
            nanochat.NanochatGPTModel.set_input_tensor = detached
        mtp_loss = loop.mtp_loss
        if case.get("negative") == "mtp_stage_skips":
            # negative control: a stage without MTP depths skips the MTP loss's collectives (the hang)
            def skipping(micro_batches, device, mtp_loss=mtp_loss):
                from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
                return {} if MTPLossLoggingHelper.tracker.get("loss_values") is None else mtp_loss(micro_batches,
                                                                                                   device)
            loop.mtp_loss = skipping
        from megatron_kappa.model import embedding_copy
        sync = embedding_copy.all_reduce_grads
        if case.get("negative") == "embedding_copy_unsynced":
            # negative control: MTP's embedding copy on the last stage keeps its own gradient
            embedding_copy.all_reduce_grads = lambda model: None
        if case.get("negative") == "zero2_pipeline":
            # negative control: ZeRO-2 with pipeline stages, set past the config check that refuses it
            cfg = load_config("configs/tiny.yaml", [o for o in case["overrides"] if not o.startswith("zero.stage=")])
            cfg.zero.stage = 2
        else:
            cfg = load_config("configs/tiny.yaml", case["overrides"])
        from megatron_kappa.model import build
        tconfig = build.transformer_config
        if case.get("negative") == "batched_p2p":
            # negative control: virtual stages with megatron's batched p2p ops (its default)
            def batched(*a, tconfig=tconfig, **k):
                config = tconfig(*a, **k)
                config.batch_p2p_comm = True
                return config
            build.transformer_config = batched
        undo_cp = context_parallel_negative(case.get("negative"))
        from megatron_kappa.optim import sharded_alpha
        whole_alpha = sharded_alpha.blocks
        if case.get("negative") == "alpha_per_shard":
            # negative control: each rank orthogonalises its own shard of κ's α (before sharded_alpha)
            sharded_alpha.blocks = lambda: None
        initialize = engine.initialize
        if case.get("report_offload"):
            def reported(*a, **k):
                built = initialize(*a, **k)
                print(f"== cpu_offload {built[1].cpu_offload}", flush=True)
                return built
            engine.initialize = reported
        loop.run(cfg, log=log)
        loop.mtp_loss = mtp_loss
        engine.initialize = initialize
        build.transformer_config = tconfig
        embedding_copy.all_reduce_grads = sync
        undo_cp()
        sharded_alpha.blocks = whole_alpha
    engine.wire_experts = wire
    groups.teardown()  # as launch/pretrain.py ends: every group's threads joined before the exit


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
