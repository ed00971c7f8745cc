"""The Drafter contract of the evaluator and its adapter for every draft_model architecture.

A Drafter reads a DecodeContext (the verified prefix before the anchor and the target's features there) and
returns a Proposal: γ tokens, the distributions they were drawn from, and its confidences when it has a head for
them. `DSparkDrafter` adapts any registered draft model through one method, `model.draft_block(batch,
temperature, generator) -> (tokens_NK, probs_NKV, conf_logit_NK | None)` (draft_model/model.py, eagle3.py,
draft_lm.py): the sampling of an architecture lives beside its training forward, so the evaluator never reaches
into a model's heads and a new architecture needs no evaluator change.

Calibration: `load_drafter(export_dir, target)` is how every consumer loads an exported draft; when the export
holds calibration.json (launch/calibrate_draft.py) the adapter reports STS-calibrated confidences
σ(logit_k / T_k) in Proposal.conf_K and keeps the raw logits in Proposal.conf_logit_K, so recording and refitting
still see them. It is applied here, not in pipeline/export.load_exported_draft, because the model stays the
architecture only (its confidence head emits logits) and the adapter is where raw and calibrated meet.

Legend (shape suffixes):  L verified prefix positions   K block size γ   V vocabulary   F context feature width
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from draft_model.batch import BlockBatch

__all__ = ["AUTOREGRESSIVE", "CALIBRATION_FILE", "DecodeContext", "Drafter", "DSparkDrafter", "Proposal", "TargetOnly",
           "load_drafter", "make_drafter"]

CALIBRATION_FILE = "calibration.json"  # STS temperatures beside an exported draft (serving/calibration.py)
AUTOREGRESSIVE = "autoregressive"  # the name TargetOnly reports under


@dataclass
class DecodeContext:
    """What a drafter may read: the verified prefix before the anchor and the target's features there."""

    ids_L: torch.Tensor  # int64 [L] verified tokens at positions 0..p-1 (the anchor, at p, is passed separately)
    feats_LF: torch.Tensor  # [L, F] target hidden states at those positions for Drafter.target_layers ([L, 0]
    #                         when the drafter asked for none)


@dataclass
class Proposal:
    """One drafted block."""

    tokens_K: torch.Tensor  # int64 drafted tokens x_1..x_γ
    probs_KV: torch.Tensor  # the distributions they were drawn from at the decoding temperature (one-hot: greedy)
    conf_K: torch.Tensor | None = None  # conditional confidences c_k in [0, 1] as the drafter reports them
    conf_logit_K: torch.Tensor | None = None  # the raw pre-sigmoid logits behind conf_K (None: not a logit model)


class Drafter(Protocol):
    name: str
    block_size: int  # γ drafted tokens per round
    target_layers: list[int]  # target hidden states wanted in DecodeContext.feats_LF (-1 = LM-head input)

    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> Proposal:
        ...


class DSparkDrafter:
    """A draft model (any architecture with `draft_block`: DSpark, DFlash, Eagle3, MTP-1, the draft LM) as a
    Drafter: one block at the anchor of a single sequence. `sts_temperatures` (T_1..T_γ) calibrate the reported
    confidences."""

    def __init__(self, model: nn.Module, name: str = "dspark", sts_temperatures=None) -> None:
        if not callable(getattr(model, "draft_block", None)):
            raise ValueError(f"{type(model).__name__} has no draft_block(batch, temperature, generator): "
                             "it cannot draft")
        self.model = model.eval()
        self.name = name
        self.block_size = model.cfg.block_size
        # a tokens-only draft (DraftLM) reads no feature: ask the target for none (DecodeContext.feats_LF is [L, 0])
        reads = getattr(model, "reads_target_features", True)
        self.target_layers = list(model.cfg.target_layers) if reads else []
        self.sts_temperatures: list[float] | None = None
        self._t_K: torch.Tensor | None = None
        if sts_temperatures is not None:
            t = [float(x) for x in sts_temperatures]
            if len(t) != self.block_size or not all(x > 0 for x in t):
                raise ValueError(f"need {self.block_size} positive STS temperatures (one per draft position), "
                                 f"got {t}")
            self.sts_temperatures = t

    def block_batch(self, ctx: DecodeContext, anchor_token: int, start: int = 0) -> BlockBatch:
        """A one-sequence, one-block BlockBatch for the block at the anchor, with context rows start..p-1."""
        feats_LF = ctx.feats_LF[start:]
        T = feats_LF.shape[0] + 1
        dev = feats_LF.device
        return BlockBatch(
            input_ids_T=torch.cat([ctx.ids_L[start:], torch.tensor([anchor_token], device=dev)]),
            # the anchor's own row is never read: a block sees context strictly before its anchor
            ctx_feats_TF=torch.cat([feats_LF, feats_LF.new_zeros(1, feats_LF.shape[1])]),
            final_hidden_TD=feats_LF.new_zeros(1, self.model.cfg.hidden_size).expand(T, -1),  # training-only
            seq_start_S1=torch.tensor([0, T], device=dev),
            block_seq_N=torch.zeros(1, dtype=torch.long, device=dev),
            anchor_pos_N=torch.tensor([T - 1], device=dev),
            valid_NK=torch.ones(1, self.block_size, dtype=torch.bool, device=dev),
        )

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> Proposal:
        window, p = self.model.cfg.sliding_window, ctx.ids_L.shape[0]
        # with a sliding window only the last `window` context tokens are visible: hand over just those; shifting
        # every position by the same amount leaves RoPE attention unchanged (it depends on differences only)
        batch = self.block_batch(ctx, anchor_token, start=max(0, p - window) if window > 0 else 0)
        tokens_NK, probs_NKV, logit_NK = self.model.draft_block(batch, temperature, generator)
        if logit_NK is None:
            return Proposal(tokens_NK[0], probs_NKV[0])
        logit_K = logit_NK[0].float()
        if self.sts_temperatures is None:
            return Proposal(tokens_NK[0], probs_NKV[0], torch.sigmoid(logit_K), logit_K)
        if self._t_K is None or self._t_K.device != logit_K.device:
            self._t_K = torch.tensor(self.sts_temperatures, dtype=torch.float64, device=logit_K.device)
        # σ(logit / T) in float64, as serving.calibration.apply_sts computes it
        return Proposal(tokens_NK[0], probs_NKV[0], torch.sigmoid(logit_K.double() / self._t_K).float(), logit_K)


class TargetOnly:
    """No draft at all (γ = 0): every round is one target forward over the anchor and emits the one token the
    target samples there. Plain autoregressive decoding, but through the same session, KV cache and sampler as
    every drafter, so that a drafter's end-to-end speed-up is its tokens/s over this one's on the same prompts."""

    name = AUTOREGRESSIVE
    block_size = 0
    sts_temperatures = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.target_layers: list[int] = []  # reads no feature

    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> Proposal:
        dev = ctx.ids_L.device
        return Proposal(torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, self.vocab_size, device=dev))


def make_drafter(model: nn.Module, name: str | None = None, sts_temperatures=None) -> DSparkDrafter:
    """The Drafter for a trained draft of any registered architecture."""
    arch = getattr(getattr(model, "cfg", None), "arch", type(model).__name__)
    return DSparkDrafter(model, name or arch, sts_temperatures)


def load_drafter(export_dir: str | Path, target: nn.Module, name: str | None = None,
                 calibrated: bool = True) -> DSparkDrafter:
    """An exported draft (pipeline/export.py) on `target`'s embedding/LM head and device, as a
    Drafter; calibrated by export_dir/calibration.json when present and `calibrated`."""
    from pipeline.export import load_exported_draft
    from serving.calibration import load_calibration
    from workers.frozen_target.model import embedding_weights

    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"no exported draft at {export_dir}")
    model = load_exported_draft(export_dir, *embedding_weights(target))
    model.to(target.get_output_embeddings().weight.device)
    temps = None
    if calibrated and (export_dir / CALIBRATION_FILE).is_file():
        temps = load_calibration(export_dir / CALIBRATION_FILE).temperatures
        if len(temps) != model.cfg.block_size:
            raise ValueError(f"{export_dir / CALIBRATION_FILE} has {len(temps)} temperatures for a draft of "
                             f"block size {model.cfg.block_size}")
    return make_drafter(model, name or export_dir.parent.name, temps)
