"""Teacher-forced acceptance of trained drafts on held-out target replies, paired: a low-variance comparison.

Real speculative decoding (bench/drafters.py, evaluation/) measures τ over a handful of prompts, where the prompt
moves τ more than small training choices do. This script instead samples replies from the target (temperature 1)
on held-out HumanEval / GSM8K / MT-Bench prompts once, packs every reply with --anchors blocks per sequence, and
runs each draft teacher-forced on the same blocks (fp32 loss matmuls whatever the draft was trained with):
per slot c* = 1 − TV(p_d, p_t), the acceptance probability of that slot given its prefix was accepted, and per
block the expected accepted length 1 + Σ_k Π_{i<=k} c*_i. Drafts are compared pairwise on per-sequence means
(standard error over the held-out sequences), so both see exactly the same positions.

Run: python bench/heldout_acceptance.py fp32=runs/a/runs/dspark/export bf16=runs/b/runs/dspark/export
     (--prompts 30 --max-new 128: about 10 minutes of sampling on 2 cores, cached in --cache)
Used for the loss.matmul_dtype default (docs/design-notes.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch


def sample_replies(target, tok, prompts: int, max_new: int, seed: int) -> list[dict]:
    from evaluation.prompts import resolve_prompt_sets
    from pipeline.data.chat import render_prompt

    torch.manual_seed(seed)
    rows, t0 = [], time.time()
    for ds, items in resolve_prompt_sets(["humaneval", "gsm8k", "mtbench"], prompts).items():
        for i, p in enumerate(items):
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids = torch.tensor([render_prompt(tok, msgs)])
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=max_new, pad_token_id=tok.eos_token_id)
            rows.append(dict(dataset=ds, index=i, ids=out[0].tolist(), prompt_len=int(ids.shape[1])))
        print(f"sampled {ds}: {len(items)} replies ({time.time() - t0:.0f} s)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("drafts", nargs="+", help="name=export_dir (pipeline/export.py)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", type=int, default=30, help="held-out prompts per set")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--anchors", type=int, default=48, help="blocks per held-out sequence")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--cache", default="runs/heldout_replies.pt")
    args = p.parse_args()
    drafts = {}
    for d in args.drafts:
        name, sep, path = d.partition("=")
        if not sep or not Path(path, "config.json").is_file():
            sys.exit(f"error: {d!r} is not name=export_dir of an exported draft")
        drafts[name] = path

    from draft_model.config import LossConfig
    from draft_model.loss import block_tau, draft_loss
    from pipeline.contracts import FeatureBatch
    from pipeline.export import load_exported_draft
    from pipeline.packing import pack
    from workers.frozen_target.model import capture_features, embedding_weights, load_target, resolve_target_path

    torch.set_grad_enabled(False)
    target, tok = load_target(resolve_target_path(args.target), torch.float32)
    cache = Path(args.cache)
    if cache.is_file():
        rows = torch.load(cache)
    else:
        rows = sample_replies(target, tok, args.prompts, args.max_new, args.seed)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rows, cache)
    embed, head = embedding_weights(target)
    models = {name: load_exported_draft(path, embed, head) for name, path in drafts.items()}
    first, *_ = models.values()
    layers, K = list(first.cfg.target_layers), first.cfg.block_size
    for name, model in models.items():
        if model.cfg.block_size != K or list(model.cfg.target_layers) != layers:
            sys.exit(f"error: {name} has another block size or target layers than {next(iter(models))}")
    parts_T = {k: [] for k in ("ids", "mask", "ctx", "final")}
    starts = [0]
    for r in rows:
        x = torch.tensor(r["ids"])[None]
        ctx, final = capture_features(target, x, torch.ones_like(x), layers)
        mask = torch.zeros(x.shape[1], dtype=torch.bool)
        mask[r["prompt_len"]:] = True
        for k, v in zip(parts_T, (x[0], mask, ctx[0], final[0])):
            parts_T[k].append(v)
        starts.append(starts[-1] + x.shape[1])
    fb = FeatureBatch(batch_index=0, sample_ids=tuple(range(len(rows))), input_ids_T=torch.cat(parts_T["ids"]),
                      loss_mask_T=torch.cat(parts_T["mask"]), seq_start_S1=torch.tensor(starts),
                      ctx_feats_TF=torch.cat(parts_T["ctx"]), final_hidden_TD=torch.cat(parts_T["final"]))
    batch, _ = pack([fb], block_size=K, anchors_per_seq=args.anchors, seed=0)
    seq_N = batch.block_seq_N.numpy()
    seqs = [s for s in range(len(rows)) if (seq_N == s).any()]
    print(f"{len(rows)} held-out replies, {batch.num_blocks} blocks, {int(batch.valid_NK.sum())} trained positions",
          flush=True)
    per_seq = {}
    for name, model in models.items():
        loss = draft_loss(model, batch, LossConfig(matmul_dtype="float32"))
        c_NK, v_NK = loss.c_star_NK, batch.valid_NK
        tau_N = block_tau(c_NK, v_NK).numpy()
        per_seq[name] = np.array([tau_N[seq_N == s].mean() for s in seqs])
        slots = " ".join(f"{c_NK[:, k][v_NK[:, k]].mean().item():.3f}" for k in range(K))
        print(f"{name:<12} expected tau {tau_N.mean():.4f}  c* per slot {slots}  "
              f"CE {float(loss.ce_sum / loss.weight_sum):.3f}", flush=True)
    names = list(per_seq)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = per_seq[a] - per_seq[b]
            print(f"{a} - {b}: expected tau {d.mean():+.4f} +- {d.std(ddof=1) / math.sqrt(len(d)):.4f} "
                  f"(standard error over {len(d)} sequences)")


if __name__ == "__main__":
    main()
