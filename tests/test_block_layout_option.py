"""draft.block_layout: the bonus-anchor layout vLLM's DFlash proposer reads (docs/vllm-serving.md).

    python -m pytest -q tests/test_block_layout_option.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from draft_fixtures import D, frozen_weights, make_batch, tiny

from draft_model.config import DraftConfig, LossConfig
from draft_model.loss import draft_loss
from draft_model.model import DraftModel
from draft_model.presets import draft_preset

GAMMA = 4


def _models(head: str = "none") -> tuple[DraftModel, DraftModel]:
    """A bonus-anchor draft of γ predictions and an anchor-layout draft of γ+1 slots with the same weights."""
    embed_VD, lm_VD = frozen_weights()
    cfg = tiny(draft_preset("dflash"), block_size=GAMMA, num_layers=2, head=head, target_layers=[1, 2])
    torch.manual_seed(0)
    bonus = DraftModel(replace(cfg, block_layout="bonus_anchor"), embed_VD, lm_VD)
    wide = DraftModel(replace(cfg, block_size=GAMMA + 1), embed_VD, lm_VD)
    wide.load_state_dict(bonus.state_dict())
    return bonus, wide


def test_bonus_anchor_runs_anchor_plus_gamma_masks_and_drops_the_anchor_slot():
    """Slot k >= 1 of the γ+1 block [anchor, MASK x γ] at positions p..p+γ is the bonus-anchor draft's output
    k-1: the prediction of the token at p+k, which is what labels_NK[:, k-1] holds."""
    bonus, wide = _models()
    batch = make_batch([20, 13], [(0, 0), (0, 9), (1, 4), (1, 11)], GAMMA, 2 * D)
    wide_batch = batch.with_anchor_slot()
    assert wide_batch.block_size == GAMMA + 1 and bool(wide_batch.valid_NK[:, 0].all())
    assert torch.equal(wide_batch.slot_positions_NK()[:, 1:], batch.slot_positions_NK() + 1)
    h_bonus = bonus.backbone_hidden(batch)
    h_wide = wide.backbone_hidden(wide_batch)
    assert h_bonus.shape == (4, GAMMA, D)
    assert torch.allclose(h_bonus, h_wide[:, 1:], atol=1e-6)
    # not the anchor layout's reading of the same weights: slot k there sits one position earlier
    h_anchor = DraftModel(replace(bonus.cfg, block_layout="anchor"), bonus.frozen_embed_VD, bonus.frozen_lm_head_VD)
    h_anchor.load_state_dict(bonus.state_dict())
    assert (h_anchor.backbone_hidden(batch) - h_bonus).abs().max() > 1e-2


def test_bonus_anchor_trains_and_drafts_gamma_tokens_with_a_markov_head():
    bonus, _ = _models(head="markov")
    batch = make_batch([20, 13], [(0, 0), (0, 9), (1, 4)], GAMMA, 2 * D)
    assert bonus(batch).hidden_NKD.shape == (3, GAMMA, D)
    parts = draft_loss(bonus, batch, LossConfig())
    assert float(parts.weight_sum) > 0
    parts.total().backward()
    assert bonus.backbone.layers[0].attn.q_proj.weight.grad.abs().sum() > 0
    tokens_NK, probs_NKV, _ = bonus.draft_block(batch, 0.0)
    assert tokens_NK.shape == (3, GAMMA) and probs_NKV.shape[:2] == (3, GAMMA)


@pytest.mark.parametrize("arch", ["eagle3", "draft-lm"])
def test_bonus_anchor_is_a_dspark_option(arch):
    cfg = replace(draft_preset(arch), block_layout="bonus_anchor")
    with pytest.raises(ValueError, match="draft.block_layout='bonus_anchor' is a block layout of arch 'dspark'"):
        cfg.validate()


def test_unknown_block_layout_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"draft\.block_layout"):
        DraftConfig(block_layout="bonus").validate()
