"""A parallel layout as the planner sees it (TP, PP, EP, ETP, CP, virtual stages in a world of
ranks), the config split by it, and the checks that refuse a layout the model cannot be split by."""
from __future__ import annotations

import dataclasses

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import Config, ConfigError, ParallelConfig
from megatron_kappa.config.checks import validate
from megatron_kappa.config.world import check_batch, check_world
from megatron_kappa.model.layout import ModelLayout, model_layout


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1  # context parallelism (parallel.cp; the estimate prices the trainer's all-gather: plan.context)
    vpp: int = 1  # virtual pipeline stages per rank (parallel.vpp: interleaved 1F1B)

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas of the model, each with its own micro-batches."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def zero_dp(self) -> int:
        """The group dense gradients are reduced over and ZeRO partitions over: DP × CP (megatron's
        data-parallel group with context parallelism; the CP ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Data-parallel size of the experts (megatron's expert-data-parallel group)."""
        return self.world // (self.ep * self.etp * self.pp)

    def label(self) -> str:
        extra = f" CP{self.cp}" * (self.cp > 1) + f" VPP{self.vpp}" * (self.vpp > 1)
        # a world the layout does not divide has no data-parallel size: "?" rather than a floor of 0
        dp = self.dp if self.world % (self.tp * self.pp * self.cp) == 0 else "?"
        edp = self.edp if self.world % (self.ep * self.etp * self.pp) == 0 else "?"
        return f"TP{self.tp} PP{self.pp}{extra} EP{self.ep} ETP{self.etp} DP{dp} (EDP{edp})"


def layout_of(par: ParallelConfig, world: int) -> Layout:
    return Layout(world=world, tp=par.tp, pp=par.pp, ep=par.ep, etp=par.expert_tp, cp=par.cp, vpp=par.vpp)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` in `layout`; the config's uneven stage split only for its own number of stages (its
    layout string also for its own virtual stages; other virtual stages are the planner's sums)."""
    same_pp = layout.pp == cfg.parallel.pp
    same_chunks = same_pp and layout.vpp == cfg.parallel.vpp
    par = dataclasses.replace(cfg.parallel, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, cp=layout.cp,
                              first_stage_layers=cfg.parallel.first_stage_layers if same_pp else None,
                              last_stage_layers=cfg.parallel.last_stage_layers if same_pp else None,
                              layout=cfg.parallel.layout if same_chunks else None,
                              vpp=cfg.parallel.vpp if same_chunks else 1)
    return dataclasses.replace(cfg, parallel=par)


def model_shape(cfg: Config, layout: Layout) -> ModelLayout:
    """The model's layout (MoE layers, stages, the vocabulary padded for this TP) under `layout`."""
    return model_layout(with_layout(cfg, layout))


def check(cfg: Config, layout: Layout):
    """One-line errors for a layout the model cannot be split by: the trainer's own checks of the
    config under this layout, and of the layout against the world size."""
    moe, shape = cfg.model.moe, model_layout(cfg)
    if not routers.lookup(moe.router).planned and shape.has_moe:
        raise ConfigError(f"plan: model.moe.router: {moe.router} is not modelled by the planner")
    if not attention_kinds.of(cfg.model).planned:  # a kind registered without the planner's counts
        raise ConfigError(f"plan: {attention_kinds.KEY}: {attention_kinds.name_of(cfg.model)} is not modelled by "
                          "the planner")
    if layout.world % (layout.tp * layout.pp * layout.cp):  # the factors say it all: no layout label
        raise ConfigError(f"plan: world size {layout.world} is not divisible by tp × pp × cp = "
                          f"{layout.tp} × {layout.pp} × {layout.cp}")
    split = with_layout(cfg, layout)
    # the EP overlap is a schedule, not a split, and its checks need the layout's virtual stages,
    # which the split leaves out: plan.accepted judges it in the config the trainer would read
    split = dataclasses.replace(split, parallel=dataclasses.replace(
        split.parallel, overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False))
    try:
        if cfg.model.seq_length % (2 * layout.cp):  # megatron's causal load balance: 2·cp chunks
            raise ConfigError(f"plan: model.seq_length {cfg.model.seq_length} is not divisible by 2 × cp")
        validate(split)
        check_world(split.parallel, layout.world, shape.experts)  # experts span the CP ranks too (megatron)
        check_batch(cfg.train, layout.dp)
        if layout.vpp > max(model_shape(cfg, layout).stage_counts()):
            raise ConfigError(f"plan: {layout.vpp} virtual stages but no pipeline stage has that many layers")
    except ConfigError as e:
        raise ConfigError(f"{e} ({layout.label()})") from None
