"""The softmax router's pieces (megatron_kappa.routers' `softmax` entry): megatron's top-k router,
or its z-loss or κ subclass, in megatron's MoE layer or the sorted one; the sigmoid router uses
the same two (model/routers/sigmoid.py)."""
from __future__ import annotations

from functools import partial

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from megatron_kappa import routers
from megatron_kappa.config import MoEConfig
from megatron_kappa.kappa import KappaSettings
from megatron_kappa.model.moe import CapacityRule, KappaMoELayer, KappaRouter, ZLoss, ZLossRouter
from megatron_kappa.model.sorted_dispatch import SortedMoELayer


def topk_router(moe: MoEConfig, kappa: KappaSettings | None):
    """The router of the top-k kinds (softmax, sigmoid): megatron's TopKRouter (the stock spec's),
    ZLossRouter for the authors' z-loss or capacity rule, or KappaRouter, which also hands on the logit, for κ
    experts."""
    z_loss = ZLoss(moe.z_loss_form, moe.z_loss_input_grad_scale)
    rule = CapacityRule(moe.capacity, moe.drop_order)
    if kappa is not None:
        return partial(KappaRouter, kappa=kappa, z_loss=z_loss, capacity_rule=rule)
    if z_loss == ZLoss() and rule == CapacityRule():
        return TopKRouter
    return partial(ZLossRouter, z_loss=z_loss, capacity_rule=rule)


def topk_layer(moe: MoEConfig, kappa: bool):
    """The MoE layer of the top-k kinds: the sorted dispatcher's (it moves the logit channel like
    the probabilities), or megatron's, whose dispatcher the κ layer swaps for one that carries the
    logit."""
    if moe.dispatcher == "sorted":
        return SortedMoELayer
    return KappaMoELayer if kappa else MoELayer


routers.implement("softmax", router=topk_router, layer=topk_layer)
