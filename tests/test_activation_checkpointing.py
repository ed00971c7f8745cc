"""train.activation_checkpointing: checkpointing every draft decoder layer (workers/trainer/step.checkpoint_layers)
leaves the loss, the gradients and the MoE balance update unchanged, and the layers do run again in the backward.

Run: python -m pytest tests/test_activation_checkpointing.py -q
"""

from __future__ import annotations

import pytest
import torch
from draft_fixtures import frozen_weights, make_batch, moe_mhc_cfg

from draft_model.config import LossConfig
from draft_model.registry import build_draft
from workers.trainer.step import (
    DraftWithLoss,
    apply_moe_balance,
    as_loss_parts,
    checkpoint_layers,
    setup_moe_balance,
)

K = 4
BATCHES = [make_batch([23, 17], [(0, 3), (0, 9), (0, 15), (1, 0), (1, 8)], K, feat_width=32, seed=1),
           make_batch([15, 7, 11], [(0, 2), (0, 6), (1, 3), (2, 8)], K, feat_width=32, seed=2)]


def _run(checkpointed: bool, window: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    cfg = moe_mhc_cfg(block_size=K, sliding_window=window)
    loss_cfg = LossConfig()
    module = DraftWithLoss(build_draft(cfg, *frozen_weights()), loss_cfg).train()
    setup_moe_balance(module.draft)  # deferred bias update, as every trainer runs it
    if checkpointed:
        assert checkpoint_layers(module.draft) == cfg.num_layers
    calls = []
    for layer in module.draft.backbone.layers:
        layer.attn.register_forward_hook(lambda *_: calls.append(1))
    losses = []
    for batch in BATCHES:  # two micro-batches of one optimizer step: gradients and loads accumulate
        parts = as_loss_parts(module(batch), loss_cfg)
        loss = parts.total(parts.weight_sum) + parts.aux_loss
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    # every tensor the modules hold besides parameters (buffers, the MoE's per-step load sum): a recompute that
    # counted its forward's load again would change them
    grads.update({f"{name}.{k}": v.clone() for name, m in module.named_modules() for k, v in vars(m).items()
                  if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)})
    apply_moe_balance(module)
    grads.update({n: b.clone() for n, b in module.named_buffers() if n.endswith("router_bias_E")})
    return losses, grads, len(calls)


@pytest.mark.parametrize("window", [0, 6])
def test_checkpointed_layers_give_the_same_loss_gradients_and_balance_update(window):
    l_ref, g_ref, calls_ref = _run(False, window)
    l_ac, g_ac, calls_ac = _run(True, window)
    layers = moe_mhc_cfg().num_layers
    assert calls_ref == layers * len(BATCHES) and calls_ac == 2 * calls_ref  # recomputed in the backward
    torch.testing.assert_close(l_ac, l_ref, atol=1e-6, rtol=1e-6)
    assert g_ac.keys() == g_ref.keys() and sum(n.endswith("router_bias_E") for n in g_ref) == layers
    assert len(g_ref) > len(dict(DraftWithLoss(build_draft(moe_mhc_cfg(), *frozen_weights()),
                                               LossConfig()).named_parameters())) + layers
    assert any(g.abs().sum() > 0 for n, g in g_ref.items() if n.endswith("router_bias_E"))  # the bias moved
    for name in g_ref:
        torch.testing.assert_close(g_ac[name], g_ref[name], atol=1e-6, rtol=1e-5, msg=name)
