"""Hand-built packed batches and tiny configs shared by the draft-model tests (not a test module)."""

from __future__ import annotations

from dataclasses import replace

import torch

from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig, MoEConfig

V, D = 96, 32
MASK_ID = 3  # draft.mask='token' presets in tests: SmolLM2's <repo_name>, which no test data holds


def make_batch(seq_lens: list[int], blocks: list[tuple[int, int]], block_size: int, feat_width: int,
               seed: int = 0, vocab: int = V, hidden: int = D) -> BlockBatch:
    """Random tokens/features for `seq_lens` sequences, one block per (sequence, anchor position)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    seq_start = torch.tensor([0] + seq_lens).cumsum(0)
    block_seq = torch.tensor([s for s, _ in blocks])
    anchor = torch.tensor([p for _, p in blocks])
    k = torch.arange(block_size)
    valid = anchor[:, None] + k[None, :] + 1 < torch.tensor(seq_lens)[block_seq][:, None]
    return BlockBatch(
        input_ids_T=torch.randint(0, vocab, (T,), generator=g),
        ctx_feats_TF=torch.randn(T, feat_width, generator=g),
        final_hidden_TD=torch.randn(T, hidden, generator=g),
        seq_start_S1=seq_start,
        block_seq_N=block_seq,
        anchor_pos_N=anchor,
        valid_NK=valid,
    )


def frozen_weights(seed: int = 0, vocab: int = V, hidden: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=g) * 0.5, torch.randn(vocab, hidden, generator=g) * hidden ** -0.5)


def tiny(cfg: DraftConfig, **overrides) -> DraftConfig:
    """Shrink any preset to test size (keeps its structure: ffn, residual, head, window, γ)."""
    small = dict(vocab_size=V, hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=0, intermediate_size=64,
                 head_rank=16, rnn_state_size=24, moe=replace(cfg.moe, num_experts=4, top_k=2,
                                                              expert_intermediate_size=32),
                 mhc_streams=3, sliding_window=min(cfg.sliding_window, 6),
                 mask_token_id=MASK_ID if cfg.mask == "token" and cfg.mask_token_id < 0 else cfg.mask_token_id)
    if cfg.arch == "dsv4":  # DeepSeek-V4's fixed forms: one shared K = V head, 4 streams; its own ranks shrunk
        small.update(num_kv_heads=1, mhc_streams=4, head_dim=8,
                     dsv4=replace(cfg.dsv4, q_lora_rank=16, rope_head_dim=4, o_lora_rank=8))
    small.update(overrides)
    return replace(cfg, **small)


def dense_cfg(**overrides) -> DraftConfig:
    base = dict(vocab_size=V, hidden_size=D, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=64, head="markov", head_rank=16)
    base.update(overrides)
    return DraftConfig(**base)


def moe_mhc_cfg(**overrides) -> DraftConfig:
    base = dict(vocab_size=V, hidden_size=D, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn="moe", moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, expert_intermediate_size=32),
                residual="mhc", mhc_streams=3, head="rnn", head_rank=16, rnn_state_size=24)
    base.update(overrides)
    return DraftConfig(**base)


def fit_fixed_batch(model, loss_fn, steps: int = 300, lr: float = 1e-2) -> list[float]:
    """Adam on one fixed batch until the loss is 8x below its start (or `steps`); returns the losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses: list[float] = []
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if losses[-1] < losses[0] / 8:
            break
    return losses


def greedy_target_batch(batch: BlockBatch, lm_head_VD: torch.Tensor, scale: float = 8.0) -> BlockBatch:
    """`batch` with tokens a greedy target would emit, x_{j+1} = argmax LM_head(final_hidden_j) (the first token of
    each sequence kept), and final hidden states scaled by `scale` to sharpen p_t: so p_t is learnable."""
    final = batch.final_hidden_TD * scale
    ids = batch.input_ids_T.clone()
    nxt = (final @ lm_head_VD.t()).argmax(-1)
    first = set(batch.seq_start_S1[:-1].tolist())
    for t in range(1, ids.shape[0]):
        if t not in first:
            ids[t] = nxt[t - 1]
    return replace(batch, input_ids_T=ids, final_hidden_TD=final)
