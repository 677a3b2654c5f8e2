"""The router kinds (`model.moe.router`), each one entry of one registry (`ROUTERS`; `register`
adds one at run time).

  softmax   top-k of a softmax with megatron's Switch aux loss (the paper).
  sigmoid   top-k of a sigmoid balanced without an aux loss by a non-trained expert bias, moved
            after every optimizer step (Trinity; megatron_kappa.parallel.grads.update_expert_bias).
  softmoe   truncated LapSum soft top-k with learned per-layer budgets: a variable number of
            experts per token (docs/softmoe.md; megatron_kappa.model.softmoe).

Everything that depends on the router kind asks its entry (`lookup(cfg.model.moe.router)`), and
nothing else compares the router's name:
  config.schema      the allowed names (checked when a config is validated, so a router registered
                     at run time is accepted), the key's help text, `MoEConfig.active_experts`
  config.checks      the router's own config rules (`validate`), the sorted dispatcher (`topk`),
                     eval.capacity_factor (`capacity`), model.moe.seq_aux_loss (`seq_aux_loss`)
  model.build        megatron's TransformerConfig values (`megatron`), the router and MoE-layer
                     classes (`router`, `layer`; κ on or off)
  config.checks      also pipeline stages (`pipeline_refusal`);  plan: the planner (`planned`)
  train.loop         the after-step hook (`after_step`), the logged metrics (`metrics`)
  export             the score function the exported models run (`hf_score`), or why a model
                     routed by it is refused (`export_refusal`)
  bench/throughput   one device's default dispatcher (sorted, for a `topk` router)

Torch-free, like the config, the preflight and the planner that read it; it imports no module of
this package. The built-in routers' pieces that live in later stages (model classes, the expert-
bias update, the SoftMoE metrics) are named "module:attribute" (`_late`) and imported when the
stage that owns them calls them (build_model, the training loop), never when this module or the
config is imported. A router registered at run time gives its callables themselves.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

DEFAULT = "softmax"  # the paper's; the config's default


def _late(ref: str) -> Callable:
    """A callable standing for `module:attribute`, imported at its first call."""
    module, _, attr = ref.partition(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)
    call.ref = ref  # tests/test_routers.py resolves every one of them
    call.__name__ = call.__qualname__ = attr
    return call


def _topk(moe) -> float:
    return moe.topk


@dataclass(frozen=True)
class Router:
    """A `model.moe.router` kind. `cfg` is a megatron_kappa.config.Config, `moe` its
    model.moe section (MoEConfig)."""
    help: str  # docs/config.md: "<name> <what it is>" (model.moe.router's help lists them all)
    # cfg → megatron TransformerConfig values for the MoE layers beyond those model.build sets for
    # every router: at least moe_router_score_function and the load-balancing settings
    megatron: Callable[[Any], dict]
    # (cfg, KappaSettings or None for plain experts) → the router's spec entry (class or partial);
    # with κ it returns probs [T, E, 2] = (weight, raw logit), as KappaRouter (model/moe.py)
    router: Callable[[Any, Any], Any]
    # (cfg, κ experts: bool) → the MoE layer's spec entry (class or partial): its dispatcher must
    # carry what `router` returns
    layer: Callable[[Any, bool], Any]
    after_step: Optional[Callable[[Any, Any], None]] = None  # (model, cfg) after each optimizer step
    metrics: Optional[Callable[[Any, Any], dict]] = None  # (model, device) → metrics.jsonl keys, on logging steps
    active_experts: Callable[[Any], float] = _topk  # moe → mean experts per token (summary, N_eff)
    validate: Optional[Callable[[Any, Callable], None]] = None  # (moe, need(ok, key, msg)): its config rules
    topk: bool = True  # runs exactly model.moe.topk experts per token (the sorted dispatcher needs it)
    capacity: bool = True  # megatron's expert capacity applies: tokens can drop (eval.capacity_factor)
    pipeline_refusal: Optional[str] = None  # why it cannot be split over pipeline stages ("<name> ...")
    planned: bool = True  # the memory planner (megatron_kappa.plan) models it
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


ROUTERS: dict[str, Router] = {}


def register(name: str, router: Router) -> Router:
    """Add a router kind (at import or at run time: a config validated after this accepts
    `model.moe.router: <name>`). A name is registered once."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"model.moe.router: a router's name must be an identifier, got {name!r}")
    if not isinstance(router, Router) or not (callable(router.megatron) and callable(router.router)
                                              and callable(router.layer)):
        raise TypeError(f"model.moe.router: {name}: expected a Router with callable megatron, router and "
                        f"layer, got {router!r}")
    if name in ROUTERS and ROUTERS[name] != router:
        raise ValueError(f"model.moe.router: {name} is already registered")
    ROUTERS[name] = router
    return router


def unregister(name: str):
    """Remove a router registered at run time (tests)."""
    if name == DEFAULT:
        raise ValueError(f"model.moe.router: {name} is the default and stays registered")
    ROUTERS.pop(name, None)


def lookup(name: str) -> Router:
    """The registered router `name` (ValueError naming model.moe.router otherwise)."""
    try:
        return ROUTERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"model.moe.router: expected one of {list(ROUTERS)}, got {name!r}") from None


def names(where: Callable[[Router], bool] = lambda r: True) -> list[str]:
    """The registered names, in registration order, of the routers `where` holds for."""
    return [name for name, r in ROUTERS.items() if where(r)]


def router_help() -> str:
    """model.moe.router's help: every router's line."""
    lines = [r.help for r in ROUTERS.values()]
    return lines[0] if len(lines) == 1 else ", ".join(lines[:-1]) + ", or " + lines[-1]


# --- the built-in routers -----------------------------------------------------------------------

_topk_router = _late("megatron_kappa.model.build:topk_router")
_topk_layer = _late("megatron_kappa.model.build:topk_layer")


def _softmax_megatron(cfg) -> dict:
    return dict(moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=cfg.model.moe.aux_loss_weight)


def _sigmoid_megatron(cfg) -> dict:
    # Trinity: aux-loss-free balancing through a non-trained expert bias; DeepSeek-V3 adds a small
    # sequence-wise balance loss (model.moe.seq_aux_loss)
    seq = cfg.model.moe.seq_aux_loss
    return dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss" if seq else "none",
                moe_aux_loss_coeff=seq, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=cfg.model.moe.bias_update_rate)


_update_expert_bias = _late("megatron_kappa.parallel.grads:update_expert_bias")


def _sigmoid_after_step(model, cfg):
    """The global batch's token counts move each router's expert bias toward balance."""
    _update_expert_bias(model, cfg.model.moe.bias_update_rate)


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
                           router=_topk_router, layer=_topk_layer, hf_score="softmax"))
register("sigmoid", Router(help="sigmoid with an aux-loss-free bias (Trinity)", megatron=_sigmoid_megatron,
                           router=_topk_router, layer=_topk_layer, after_step=_sigmoid_after_step,
                           seq_aux_loss=True, hf_score="sigmoid"))
register("softmoe", Router(
    help="softmoe: truncated LapSum soft top-k with learned per-layer budgets (model.moe.softmoe)",
    # megatron's own top-k, balancing loss and capacity are not used (model/softmoe.py)
    megatron=_late("megatron_kappa.model.softmoe:megatron_kwargs"),
    router=_late("megatron_kappa.model.build:softmoe_router"),
    layer=_late("megatron_kappa.model.build:softmoe_layer"),
    metrics=_late("megatron_kappa.metrics.softmoe:softmoe_stats"),
    active_experts=_softmoe_budget, validate=_softmoe_rules, topk=False, capacity=False,
    pipeline_refusal="shares one expert budget over all MoE layers, which pipeline stages split",
    planned=False, export_refusal="the export does not implement the SoftMoE router (its variable experts per "
                                  "token and learned budgets); export a top-k router's run"))
