"""MTP-1 baseline (preset `mtp1` = eagle3 at γ = 1 on the final state, no fusion Linear): the preset and its config
rules, and the model's prediction against DeepSeek-V3's MTP formula recomputed by hand, run causally over a
whole sequence.

Run: python -m pytest tests/test_mtp1.py -q
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from draft_fixtures import D, V, frozen_weights, make_batch, tiny

from draft_model.config import FINAL_HIDDEN
from draft_model.eagle3 import Eagle3Draft
from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from pipeline.config import load_config

L = 14  # sequence length of the hand check
EPS = 1e-6


def _mtp(seed: int = 0, **overrides) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = build_draft(tiny(draft_preset("mtp1"), rms_norm_eps=EPS, **overrides), *frozen_weights())
    with torch.no_grad():  # norm weights away from 1, so that a norm applied in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model.eval()


def test_preset_is_eagle3_at_gamma_1_on_the_final_state_without_fusion():
    cfg = draft_preset("mtp1", num_target_layers=30)
    assert (cfg.arch, cfg.block_size, cfg.num_layers, cfg.target_layers, cfg.fuse_features, cfg.head,
            cfg.confidence) == ("eagle3", 1, 1, [FINAL_HIDDEN], False, "none", True)
    model = _mtp()
    assert isinstance(model, Eagle3Draft) and model.fuse is None
    assert not any(k.startswith("fuse") for k in model.state_dict())
    assert model.in_proj.weight.shape == (D, 2 * D)  # proj([norm(emb); norm(h)]), 2D -> D


@pytest.mark.parametrize("overrides, message", [
    (["draft.preset=dflash", "draft.fuse_features=false"], "fuse_features=false is the eagle3 MTP input"),
    (["draft.preset=mtp1", "draft.target_layers=[1,-1]"], "feeds one target layer"),
])
def test_bad_combinations_are_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x_LHE: torch.Tensor, pos_L: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE: pairs (i, i + E/2) rotated by pos * theta^(-2i/E)."""
    E = x_LHE.shape[-1]
    ang = pos_L[:, None].float() * theta ** (-torch.arange(0, E, 2).float() / E)  # [L, E/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x_LHE[..., : E // 2], x_LHE[..., E // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _mtp_by_hand(model: Eagle3Draft, ids_L: torch.Tensor, h_LD: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module over the sequence: row j = logits for x_{j+2} from h_j and x_{j+1}, for every
    j = 0..L-2, each position attending causally to 0..j. Written from the formula, not from the model's code."""
    cfg = model.cfg
    H, G, E = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    embed_VD, lm_VD = frozen_weights()
    u = torch.cat([_rms(embed_VD[ids_L[1:]], model.embed_norm.weight), _rms(h_LD[:-1], model.feat_norm.weight)], -1)
    u = u @ model.in_proj.weight.T  # [L-1, D]
    pos = torch.arange(L - 1)
    a = _rms(u, model.attn_norm.weight)
    at = model.attn
    q = _rope((a @ at.q_proj.weight.T).view(-1, H, E), pos, cfg.rope_theta)
    k = _rope((a @ at.k_proj.weight.T).view(-1, G, E), pos, cfg.rope_theta)
    v = (a @ at.v_proj.weight.T).view(-1, G, E)
    heads = []
    for hd in range(H):
        g = hd // (H // G)  # query heads share key/value heads in consecutive groups
        scores = q[:, hd] @ k[:, g].T / math.sqrt(E)
        scores = scores.masked_fill(torch.ones(L - 1, L - 1, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, g])
    r = u + torch.cat(heads, -1) @ at.o_proj.weight.T
    f = model.ffn
    n = _rms(r, model.ffn_norm.weight)
    out = r + (F.silu(n @ f.gate_proj.weight.T) * (n @ f.up_proj.weight.T)) @ f.down_proj.weight.T
    return _rms(out, model.final_norm.weight) @ lm_VD.T


def test_prediction_equals_deepseek_mtp_by_hand():
    model = _mtp()
    anchors = list(range(1, L - 1))  # p = 0 has no h_{-1} (eagle3 reads a zero feature there): not MTP
    batch = make_batch([L, 9], [(0, p) for p in anchors] + [(1, 4)], 1, D)  # a second sequence: never a key
    ids, h = batch.input_ids_T[:L], batch.ctx_feats_TF[:L]  # ctx_feats = the target's final state h_j
    ref_JV = _mtp_by_hand(model, ids, h)
    with torch.no_grad():
        got_NV = model(batch).hidden_NKD[:, 0] @ model.lm_head_weight().T
    # block at anchor p drafts x_{p+1} from h_{p-1} and x_p: the by-hand row j = p-1
    for n, p in enumerate(anchors):
        torch.testing.assert_close(got_NV[n], ref_JV[p - 1], atol=1e-5, rtol=1e-5)
    assert ref_JV.std() > 0.1  # non-degenerate logits
    # drafting (the evaluator's path) proposes the argmax of the same logits
    tokens_NK, _, logit_NK = model.draft_block(batch, 0.0)
    assert torch.equal(tokens_NK[: len(anchors), 0], ref_JV[[p - 1 for p in anchors]].argmax(-1))
    assert logit_NK.shape == (len(anchors) + 1, 1)


def test_mtp_reads_only_the_final_state_and_tokens_up_to_the_anchor():
    model = _mtp()
    p = 8
    batch = make_batch([L], [(0, p)], 1, D)
    with torch.no_grad():
        ref = model(batch).hidden_NKD
        later = batch.ctx_feats_TF.clone()
        later[p:] = torch.randn(L - p, D)  # h_p.. are not known when x_{p+1} is drafted
        ids = batch.input_ids_T.clone()
        ids[p + 2:] = (ids[p + 2:] + 1) % V  # x_{p+1} is the label, later tokens are the future
        assert torch.equal(model(replace(batch, ctx_feats_TF=later, input_ids_T=ids)).hidden_NKD, ref)
        earlier = batch.ctx_feats_TF.clone()
        earlier[p - 1] += 1.0
        assert (model(replace(batch, ctx_feats_TF=earlier)).hidden_NKD - ref).abs().max() > 1e-4
