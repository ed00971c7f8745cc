"""DraftModel.draft_block, the inference half of the drafter contract: it agrees with the teacher-forced training
forward on the chain it drafted, and drafting several blocks at once equals drafting each alone.

Run: python -m pytest tests/test_draft_block.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from draft_fixtures import dense_cfg, frozen_weights, make_batch

from draft_model.model import DraftModel
from draft_model.sampling import probs_at_temperature

K = 4
SEQ_LENS = [14, 9, 12]
ONE_BLOCK_EACH = [(0, 6), (1, 2), (2, 5)]  # anchors with K tokens after them inside their sequence


def _model(head: str) -> DraftModel:
    torch.manual_seed(0)
    model = DraftModel(dense_cfg(block_size=K, head=head, rnn_state_size=24), *frozen_weights()).eval()
    with torch.no_grad():  # a fresh head is a no-op (W2 = 0): make it matter
        model.head.w2_RV.normal_(std=0.5)
    return model


def _with_chain(batch, tokens_NK: torch.Tensor):
    ids = batch.input_ids_T.clone()
    ids[batch.anchor_index_N()[:, None] + 1 + torch.arange(tokens_NK.shape[1])] = tokens_NK
    return replace(batch, input_ids_T=ids)


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_block_matches_the_training_forward_on_its_own_chain(head, temperature):
    model = _model(head)
    feat = len(model.cfg.target_layers) * model.cfg.hidden_size
    batch = make_batch(SEQ_LENS, ONE_BLOCK_EACH, K, feat)
    tokens_NK, probs_NKV, logit_NK = model.draft_block(batch, temperature, torch.Generator().manual_seed(1))
    assert tokens_NK.shape == (3, K) and probs_NKV.shape == (3, K, model.cfg.vocab_size)
    with torch.no_grad():
        out = model(_with_chain(batch, tokens_NK))  # teacher forcing with the drafted tokens as the truth
    logits_NKV = out.hidden_NKD @ model.lm_head_weight().t() + out.head_factor_NKR @ model.head_w2()
    torch.testing.assert_close(probs_NKV, probs_at_temperature(logits_NKV, temperature), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logit_NK, out.conf_logit_NK, atol=1e-5, rtol=1e-4)
    if temperature == 0:
        assert torch.equal(tokens_NK, logits_NKV.argmax(-1))


def test_blocks_drafted_together_equal_each_drafted_alone():
    model = _model("rnn")
    batch = make_batch(SEQ_LENS, ONE_BLOCK_EACH, K, len(model.cfg.target_layers) * model.cfg.hidden_size)
    together = model.draft_block(batch, 0.0)
    for n, block in enumerate(ONE_BLOCK_EACH):
        alone = model.draft_block(make_batch(SEQ_LENS, [block], K, batch.ctx_feats_TF.shape[1]), 0.0)
        assert torch.equal(alone[0][0], together[0][n])
        torch.testing.assert_close(alone[2][0], together[2][n], atol=1e-5, rtol=1e-4)
