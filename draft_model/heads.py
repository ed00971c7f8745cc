"""Sequential heads: a low-rank correction of slot k's logits that depends on the previous token.

Both heads produce a factor a_k [r] with bias_k = a_k @ W2 (W2 [r, V]); the model never forms the V-sized bias
itself: the loss multiplies by W2 in vocabulary chunks, sampling does it one slot at a time.
- Markov: a_k = W1[x_{k-1}] (a rank-r bigram table W1 W2).
- RNN:    z_k = [s_{k-1}; W1[x_{k-1}]; h_k], g = sigmoid(W_g z), s_k = g * s_{k-1} + (1-g) * tanh(W_c z),
          a_k = tanh(W_o z), s_0 = 0.
Training is teacher-forced (x_{k-1} = the anchor, then the true continuation); inference calls `step` left to
right with sampled tokens. W2 starts at zero, so a fresh head is a no-op on the backbone's logits.

Both also return W1[x_{k-1}] ("prev_embed"), which the confidence head reads.

Legend: N blocks, K block size γ, D hidden, V vocab, R head rank r, S RNN state size.
"""

from __future__ import annotations

import torch
from torch import nn

from draft_model.config import DraftConfig


class SequentialHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.w1.weight, std=rank ** -0.5)
        self.w2_RV = nn.Parameter(torch.zeros(rank, vocab_size))

    def initial_state(self, hidden_ND: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, hidden_ND: torch.Tensor, prev_tokens_N: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One slot: -> (factor_NR, prev_embed_NR, new_state)."""
        raise NotImplementedError

    def teacher_forced(self, hidden_NKD: torch.Tensor, prev_tokens_NK: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots with the given previous tokens: -> (factor_NKR, prev_embed_NKR)."""
        raise NotImplementedError


class MarkovHead(SequentialHead):
    def step(self, hidden_ND, prev_tokens_N, state):
        e_NR = self.w1(prev_tokens_N)
        return e_NR, e_NR, state

    def teacher_forced(self, hidden_NKD, prev_tokens_NK):
        e_NKR = self.w1(prev_tokens_NK)  # no dependence across slots: one lookup does all of them
        return e_NKR, e_NKR


class RNNHead(SequentialHead):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, state_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.state_size = state_size
        z = state_size + rank + hidden_size
        self.w_gate = nn.Linear(z, state_size)
        self.w_cand = nn.Linear(z, state_size)
        self.w_out = nn.Linear(z, rank)

    def initial_state(self, hidden_ND):
        return hidden_ND.new_zeros(hidden_ND.shape[0], self.state_size)

    def step(self, hidden_ND, prev_tokens_N, state):
        if state is None:
            state = self.initial_state(hidden_ND)
        e_NR = self.w1(prev_tokens_N).to(hidden_ND.dtype)
        z = torch.cat([state, e_NR, hidden_ND], dim=-1)
        g = torch.sigmoid(self.w_gate(z))
        new_state = g * state + (1 - g) * torch.tanh(self.w_cand(z))
        return torch.tanh(self.w_out(z)), e_NR, new_state

    def teacher_forced(self, hidden_NKD, prev_tokens_NK):
        # the recurrence is inherently sequential over the γ slots (a handful); all blocks go in parallel
        state = self.initial_state(hidden_NKD[:, 0])
        factors, embeds = [], []
        for k in range(hidden_NKD.shape[1]):
            a, e, state = self.step(hidden_NKD[:, k], prev_tokens_NK[:, k], state)
            factors.append(a)
            embeds.append(e)
        return torch.stack(factors, dim=1), torch.stack(embeds, dim=1)


def build_head(cfg: DraftConfig) -> SequentialHead | None:
    if cfg.head == "none":
        return None
    if cfg.head == "markov":
        return MarkovHead(cfg.vocab_size, cfg.head_rank)
    if cfg.head == "rnn":
        return RNNHead(cfg.vocab_size, cfg.head_rank, cfg.hidden_size, cfg.rnn_state_size)
    raise ValueError(f"draft.head must be 'none', 'markov' or 'rnn', got {cfg.head!r}")
