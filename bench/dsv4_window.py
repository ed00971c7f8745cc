"""What llama.cpp's per-slot sliding window costs a trained v4-deepseek draft (docs/dsv4.md, departure 1).

Run: python bench/dsv4_window.py --export runs/v4-deepseek/export [--target smollm2] [--seqs 8 --len 320]

DeepSeek's reference (and draft_model/dsv4.py, which trains it) gives every slot of a block the same context
window [p - W, p); llama.cpp masks per query position, so with the GGUF's n_swa = W + 1 slot k sees only
[p + k - W, p). This takes held-out text (Python standard-library sources the default corpus does not sample: the
`email` package, by default), runs the SmolLM2 target once for the draft's context features and its own next-token
distributions, and drafts blocks whose window binds (every 4th anchor from W + γ on) both ways on the teacher path.
It prints, per slot, how often the greedy token differs and the mean total variation between the two draft
distributions, and the expected accepted length 1 + Σ_k Π_{i<=k} (1 - TV(p_draft, p_target)) under each rule,
then last:
  dsv4_window export=E blocks=N tau_reference=A tau_llamacpp=B greedy_differs=F
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import torch

from draft_model import dsv4
from draft_model.batch import BlockBatch
from draft_model.config import LossConfig
from draft_model.loss import dspark_loss, expected_tau
from pipeline.export import load_exported_draft
from workers.frozen_target.model import (
    capture_features,
    embedding_weights,
    load_target,
    load_tokenizer,
    resolve_target_path,
)

REFERENCE_CONTEXT = dsv4.DSV4Context


def llamacpp_context(batch: BlockBatch, cfg, main_x_TD: torch.Tensor) -> dsv4.DSV4Context:
    """The reference's context with llama.cpp's mask: key position p0 visible to the slot at p + k iff
    p + k - p0 < W + 1."""
    ctx = REFERENCE_CONTEXT(batch, cfg, main_x_TD)
    W, K = cfg.sliding_window, cfg.block_size
    _, pos_NW, valid_NW = batch.context_window(W)
    slot_NK = batch.slot_positions_NK()
    ctx_NKW = valid_NW[:, None, :] & (slot_NK[:, :, None] - pos_NW[:, None, :] < W + 1)
    block_NKK = torch.ones(ctx_NKW.shape[0], K, K, dtype=torch.bool)
    ctx.mask_N11L = torch.cat([ctx_NKW, block_NKK], dim=-1)[:, None]  # [N, 1, K, L]: per slot
    return ctx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", required=True, type=Path)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=320)
    p.add_argument("--package", default="email", help="a standard-library package whose sources are the text")
    args = p.parse_args()

    path = resolve_target_path(args.target)
    target, _ = load_target(path)
    tok = load_tokenizer(path)
    draft = load_exported_draft(args.export, *embedding_weights(target))
    cfg = draft.cfg
    if cfg.arch != "dsv4":
        raise SystemExit(f"error: {args.export} holds arch {cfg.arch!r}, not 'dsv4'")
    W, K = cfg.sliding_window, cfg.block_size
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / args.package).rglob("*.py"))
    ids = []
    for f in files:
        t = tok(f.read_text(errors="replace"))["input_ids"]
        if len(t) >= args.len:
            ids.append(t[:args.len])
        if len(ids) == args.seqs:
            break
    ids_SL = torch.tensor(ids)
    with torch.no_grad():
        ctx_SLF, final_SLD = capture_features(target, ids_SL, torch.ones_like(ids_SL), cfg.target_layers)
    S, L = ids_SL.shape
    anchors = np.arange(W + K, L - K - 1, 4)  # every 4th position whose window binds
    blocks = [(s, int(a)) for s in range(S) for a in anchors]
    seq_N, pos_N = torch.tensor([b[0] for b in blocks]), torch.tensor([b[1] for b in blocks])
    batch = BlockBatch(input_ids_T=ids_SL.reshape(-1), ctx_feats_TF=ctx_SLF.reshape(S * L, -1).float(),
                       final_hidden_TD=final_SLD.reshape(S * L, -1).float(),
                       seq_start_S1=torch.arange(S + 1) * L, block_seq_N=seq_N, anchor_pos_N=pos_N,
                       valid_NK=torch.ones(len(blocks), K, dtype=torch.bool))
    lm = draft.lm_head_weight()
    results = {}
    for rule in ("reference", "llamacpp"):
        dsv4.DSV4Context = llamacpp_context if rule == "llamacpp" else REFERENCE_CONTEXT  # read at each forward
        try:
            with torch.no_grad():
                out = draft(batch)
        finally:
            dsv4.DSV4Context = REFERENCE_CONTEXT
        target_NKD = batch.final_hidden_TD[batch.target_index_NK()]
        parts = dspark_loss(out.hidden_NKD, lm, batch.labels_NK(), target_NKD, batch.valid_NK,
                            LossConfig(matmul_dtype="float32"), head_factor_NKR=out.head_factor_NKR,
                            head_w2_RV=draft.head_w2())
        logits = out.hidden_NKD @ lm.t() + (out.head_factor_NKR @ draft.head_w2() if out.head_factor_NKR is not None
                                            else 0)
        results[rule] = (torch.softmax(logits, -1), float(expected_tau(parts.c_star_NK, batch.valid_NK)))
    (p_ref, tau_ref), (p_cpp, tau_cpp) = results["reference"], results["llamacpp"]
    differs_K = (p_ref.argmax(-1) != p_cpp.argmax(-1)).float().mean(0)
    tv_K = 0.5 * (p_ref - p_cpp).abs().sum(-1).mean(0)
    for k in range(K):
        print(f"slot {k}: greedy token differs {differs_K[k]:.4f}, mean TV {tv_K[k]:.5f}")
    print(f"dsv4_window export={args.export} blocks={len(blocks)} tau_reference={tau_ref:.4f} "
          f"tau_llamacpp={tau_cpp:.4f} greedy_differs={float(differs_K.mean()):.4f}")


if __name__ == "__main__":
    main()
