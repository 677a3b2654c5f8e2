"""The router kinds (`model.moe.router`), each one entry of one registry (`ROUTERS`; `register`
adds one at run time).

  softmax   top-k of a softmax with megatron's Switch aux loss (the paper).
  sigmoid   top-k of a sigmoid balanced without an aux loss by a non-trained expert bias, moved
            after every optimizer step (Trinity).
  softmoe   truncated LapSum soft top-k with learned per-layer budgets: a variable number of
            experts per token (docs/softmoe.md).

Everything that depends on the router kind asks its entry (`lookup(cfg.model.moe.router)`), and
nothing else compares the router's name:
  config.schema      the allowed names (checked when a config is validated, so a router registered
                     at run time is accepted), the key's help text, `MoEConfig.active_experts`
  config.checks      the router's own config rules (`validate`), the sorted dispatcher (`topk`),
                     eval.capacity_factor (`capacity`), model.moe.seq_aux_loss (`seq_aux_loss`)
  model.build        megatron's TransformerConfig values (`megatron`), the router and MoE-layer
                     classes (`router`, `layer`; κ on or off)
  config.checks      also pipeline stages (`pipeline_refusal`);  plan/: the planner (`planned`)
  train.loop         the after-step hook (`after_step`), the logged metrics (`metrics`)
  export             the score function the exported models run (`hf_score`), or why a model
                     routed by it is refused (`export_refusal`)
  bench/throughput   one device's default dispatcher (sorted, for a `topk` router)

An entry holds two kinds of thing. Its facts (the help line, megatron's settings, the config
rules, top-k or not, capacity, pipeline stages, the planner, the export) are data and torch-free
functions, written here. Its pieces (the router and MoE-layer classes, the after-step hook, the
metrics) need torch and megatron-core. A built-in router's pieces live in one module per router,
megatron_kappa/model/routers/<name>.py, which imports this module and hands them over when it is
imported (`implement`); the entry here holds a placeholder for each (`ROUTERS.piece`, a `Given`)
that calls what was handed over. The mechanism (register, placeholders, the handed-over table) is
megatron_kappa.registry's, which every kind's registry uses. Every arrow points down: this module
imports nothing of the package but that registry and names no module of a later stage, in an
import or in a string. Why this design:
- The facts stay here because the config, the preflight and the planner read them for every
  router, built-in or not, without importing torch (tests/test_routers.py checks it).
- The pieces sit in model/ (the model's stage), one module per router, because build_model, the
  only caller of `router` and `layer`, imports megatron_kappa.model.routers: they are handed over
  before anything asks for them. The after-step hook and the metrics are called by the training
  loop after build_model, so they live in the same module (sigmoid's expert-bias update needs only
  megatron's parallel_state; SoftMoE's metrics read its routers' counters): one module holds all
  of a router's pieces.
- Placeholders, not an entry rewritten at import: an entry copied by dataclasses.replace before
  its module was imported (a test deriving a router from softmax's) still reaches the pieces, and
  one called too early says so in one line.
- Rejected: "module:attribute" strings imported at first call (this module's former `_late`) and
  imports inside functions are arrows from this stage up to model/, parallel/ and metrics/ that a
  reader does not see where the piece is; one registry per stage (facts here, classes in model/,
  hooks in train/) would make a new router several registrations.
A router registered at run time gives its pieces themselves: one `register(name, Router(...))`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_kappa.registry import Registry

DEFAULT = "softmax"  # the paper's; the config's default


def _topk(moe) -> float:
    return moe.topk


@dataclass(frozen=True)
class Router:
    """A `model.moe.router` kind. `moe` is the model.moe section (MoEConfig). A built-in's `router`,
    `layer`, `after_step` and `metrics` are `Given` placeholders; a router registered at run time
    gives the callables."""
    help: str  # docs/config.md: "<name> <what it is>" (model.moe.router's help lists them all)
    # moe → megatron TransformerConfig values for the MoE layers beyond those model.build sets for
    # every router: at least moe_router_score_function and the load-balancing settings
    megatron: Callable[[Any], dict]
    # (moe, KappaSettings or None for plain experts) → the router's spec entry (class or partial);
    # with κ it returns probs [T, E, 2] = (weight, raw logit), as KappaRouter (model/moe.py)
    router: Callable[[Any, Any], Any]
    # (moe, κ experts: bool) → the MoE layer's spec entry (class or partial): its dispatcher must
    # carry what `router` returns
    layer: Callable[[Any, bool], Any]
    after_step: Optional[Callable[[Any, Any], None]] = None  # (model, moe) after each optimizer step
    metrics: Optional[Callable[[Any, Any], dict]] = None  # (model, device) → metrics.jsonl keys, on logging steps
    active_experts: Callable[[Any], float] = _topk  # moe → mean experts per token (summary, N_eff)
    validate: Optional[Callable[[Any, Callable], None]] = None  # (moe, need(ok, key, msg)): its config rules
    topk: bool = True  # runs exactly model.moe.topk experts per token (the sorted dispatcher needs it)
    capacity: bool = True  # megatron's expert capacity applies: tokens can drop (eval.capacity_factor)
    pipeline_refusal: Optional[str] = None  # why it cannot be split over pipeline stages ("<name> ...")
    planned: bool = True  # the memory planner (plan/) models it
    seq_aux_loss: bool = False  # its megatron settings take model.moe.seq_aux_loss (a sequence-wise balance loss)
    # the export: the score function the exported models run for it (transformers' classes and
    # modeling_kappa_moe.py's router_score): "softmax" over the top-k logits, or "sigmoid" scores
    # picked with the balance bias. None: no exported model computes it, and the export refuses a
    # model with MoE layers in one line (`export_refusal`). dataclasses.replace copies it: a
    # variant that routes otherwise than its model sets it back to None
    hf_score: Optional[str] = None
    export_refusal: str = ("no exported model computes this router (its registry entry names no Hugging Face "
                           "score function, hf_score); export a run of a built-in top-k router")

    def step_metrics(self, model, device) -> dict:
        return self.metrics(model, device) if self.metrics is not None else {}


ROUTERS: Registry[Router] = Registry("model.moe.router", Router, noun="router", needs=("megatron", "router", "layer"),
                                    default=DEFAULT, pieces_in="model/routers")
# the registry's verbs, under the names the modules of model/routers/ and a run-time router call
register, unregister, lookup, names = ROUTERS.register, ROUTERS.unregister, ROUTERS.lookup, ROUTERS.names
implement, given = ROUTERS.implement, ROUTERS.handed


def router_help() -> str:
    """model.moe.router's help: every router's line."""
    lines = [r.help for r in ROUTERS.values()]
    return lines[0] if len(lines) == 1 else ", ".join(lines[:-1]) + ", or " + lines[-1]


# --- the built-in routers -----------------------------------------------------------------------

# each one's pieces: megatron_kappa/model/routers/<name>.py (`implement`)


def _softmax_megatron(moe) -> dict:
    return dict(moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=moe.aux_loss_weight)


def _sigmoid_megatron(moe) -> dict:
    # Trinity: aux-loss-free balancing through a non-trained expert bias; DeepSeek-V3 adds a small
    # sequence-wise balance loss (model.moe.seq_aux_loss)
    seq = moe.seq_aux_loss
    return dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss" if seq else "none",
                moe_aux_loss_coeff=seq, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=moe.bias_update_rate)


def _softmoe_megatron(moe) -> dict:
    """TransformerConfig values for SoftMoE layers. megatron's own top-k, balancing loss and
    capacity are not used (model/softmoe.py); `moe_router_topk` is the cap, which bounds what
    megatron sizes by it."""
    return dict(moe_router_topk=moe.softmoe.max_experts or moe.num_experts,
                moe_router_score_function="softmax", moe_router_pre_softmax=True,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=moe.aux_loss,
                moe_router_topk_scaling_factor=None, moe_expert_capacity_factor=None)


def _softmoe_budget(moe) -> float:
    """The SoftMoE budget (the mean over layers of k_l), topk when unset."""
    return moe.topk if moe.softmoe.budget is None else moe.softmoe.budget


def _softmoe_rules(moe, need):
    sm, E = moe.softmoe, moe.num_experts
    cap = sm.max_experts or E
    need(1 <= cap <= E, "model.moe.softmoe.max_experts", f"must be in [1, num_experts={E}], got {cap}")
    need(0 < moe.active_experts <= cap, "model.moe.softmoe.budget",
         f"must be in (0, max_experts={cap}], got {moe.active_experts}")
    need(sm.temperature > 0, "model.moe.softmoe.temperature", f"must be positive, got {sm.temperature}")
    need(0 <= sm.threshold < 1, "model.moe.softmoe.threshold", f"must be in [0, 1), got {sm.threshold}")
    need(moe.capacity_factor is None, "model.moe.capacity_factor",
         "must be null with the softmoe router (it runs a variable number of experts per token; "
         "model.moe.softmoe.max_experts caps it)")


register("softmax", Router(help="softmax top-k with aux loss (paper)", megatron=_softmax_megatron,
                           router=ROUTERS.piece("softmax", "router"), layer=ROUTERS.piece("softmax", "layer"),
                           hf_score="softmax"))
register("sigmoid", Router(help="sigmoid with an aux-loss-free bias (Trinity)", megatron=_sigmoid_megatron,
                           router=ROUTERS.piece("sigmoid", "router"), layer=ROUTERS.piece("sigmoid", "layer"),
                           after_step=ROUTERS.piece("sigmoid", "after_step"), seq_aux_loss=True, hf_score="sigmoid"))
register("softmoe", Router(
    help="softmoe: truncated LapSum soft top-k with learned per-layer budgets (model.moe.softmoe)",
    megatron=_softmoe_megatron, router=ROUTERS.piece("softmoe", "router"), layer=ROUTERS.piece("softmoe", "layer"),
    metrics=ROUTERS.piece("softmoe", "metrics"), active_experts=_softmoe_budget, validate=_softmoe_rules, topk=False,
    capacity=False,
    pipeline_refusal="shares one expert budget over all MoE layers, which pipeline stages split",
    planned=False, export_refusal="the export does not implement the SoftMoE router (its variable experts per "
                                  "token and learned budgets); export a top-k router's run"))
