"""Packing density of the anchor-bounded packer vs padded per-sequence batching, on real mixed-length tokens.

Run: python bench/packing.py [--block-size 7] [--anchors 64] [--seq-per-batch 16] [--batches-per-pack 4]

Data: Python standard-library source (ast, json, email, ...) tokenized with the real SmolLM2 tokenizer and cut
into documents of 32..1024 tokens (uniform), chat-like loss mask: the first 30% of each document is the "prompt"
(not trained on), the rest the "answer". Features are zeros: density depends only on lengths and masks.

Density = supervised block slots / computed block slots (N*K). The padded baseline pads each group of
--seq-per-batch documents (in corpus order) to its longest and computes every position, of which only the
answer positions carry a loss; a length-sorted variant (the best a bucketing sampler can do) is printed too.
Last line: packing_density=X padded=Y ratio=Z for the default anchor policy (full blocks first).
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.contracts import FeatureBatch
from pipeline.packing import pack, padded_baseline_density
from workers.frozen_target.model import smollm2_tokenizer

MODULES = ["ast", "json", "email", "argparse", "inspect", "typing", "dataclasses", "textwrap", "difflib",
           "logging", "http", "collections", "pathlib", "functools"]


def stdlib_sources() -> list[str]:
    texts = []
    for name in MODULES:
        mod = __import__(name)
        path = Path(inspect.getsourcefile(mod))
        files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
        texts.extend(f.read_text(encoding="utf-8") for f in files)
    return texts


def documents(tok, rng: np.random.Generator) -> list[np.ndarray]:
    """Every source file tokenized, cut into consecutive documents of uniformly random length 32..1024."""
    docs = []
    for ids in tok(stdlib_sources(), add_special_tokens=False)["input_ids"]:
        ids = np.asarray(ids, dtype=np.int64)
        start = 0
        while start < ids.shape[0]:
            L = int(rng.integers(32, 1025))
            if ids.shape[0] - start >= 32:
                docs.append(ids[start:start + L])
            start += L
    order = rng.permutation(len(docs))  # mix files, so a batch holds unrelated lengths
    return [docs[i] for i in order]


def chat_mask(L: int, turns: bool = False) -> np.ndarray:
    """First 30% masked out; with `turns`, the same per turn of ~128 tokens (multi-turn chat: many short
    answers, so many more blocks reach a mask boundary)."""
    mask = np.ones(L, dtype=bool)
    bounds = np.linspace(0, L, max(1, round(L / 128)) + 1).astype(int) if turns else np.array([0, L])
    for a, b in zip(bounds[:-1], bounds[1:]):
        mask[a:a + int(np.ceil(0.3 * (b - a)))] = False
    return mask


def feature_batches(docs: list[np.ndarray], per_batch: int, turns: bool, width: int = 8) -> list[FeatureBatch]:
    out = []
    for b, i in enumerate(range(0, len(docs), per_batch)):
        group = docs[i:i + per_batch]
        lens = [d.shape[0] for d in group]
        T = sum(lens)
        out.append(FeatureBatch(
            b, tuple(range(i, i + len(group))), torch.from_numpy(np.concatenate(group)),
            torch.from_numpy(np.concatenate([chat_mask(n, turns) for n in lens])),
            torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64),
            torch.zeros(T, width), torch.zeros(T, width)))
    return out


def measure(fbs: list[FeatureBatch], per_pack: int, K: int, anchors: int, full_first: bool):
    useful = computed = blocks = dropped = 0
    t0 = time.perf_counter()
    for i in range(0, len(fbs), per_pack):
        _, st = pack(fbs[i:i + per_pack], K, anchors, seed=0, full_blocks_first=full_first)
        useful += st.useful_block_tokens
        computed += st.computed_block_tokens
        blocks += st.blocks
        dropped += st.sequences_dropped
    ms = 1e3 * (time.perf_counter() - t0) / max(1, -(-len(fbs) // per_pack))
    return useful / computed, blocks, dropped, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--anchors", type=int, default=64, help="anchors per sequence")
    ap.add_argument("--seq-per-batch", type=int, default=16)
    ap.add_argument("--batches-per-pack", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tok = smollm2_tokenizer()
    docs = documents(tok, np.random.default_rng(args.seed))
    lens = np.array([d.shape[0] for d in docs])
    trainable = np.array([int(chat_mask(n)[1:].sum()) for n in lens])  # positions whose next token has a loss
    print(f"corpus: {len(docs)} documents, {lens.sum()} tokens, length min/median/max "
          f"{lens.min()}/{int(np.median(lens))}/{lens.max()}, answer fraction {trainable.sum() / lens.sum():.3f}")
    padded = padded_baseline_density(lens, trainable, batch_size=args.seq_per_batch)
    padded_sorted = padded_baseline_density(np.sort(lens), trainable[np.argsort(lens, kind="stable")],
                                            batch_size=args.seq_per_batch)
    print(f"padded per-sequence baseline (batches of {args.seq_per_batch}): density {padded:.4f} "
          f"(length-sorted buckets: {padded_sorted:.4f})")

    print(f"{'mask':>6} {'K':>3} {'anchors':>7} {'policy':>11} {'density':>8} {'blocks':>8} {'dropped':>7} "
          f"{'ms/pack':>8}")
    main_density = None
    for turns in (False, True):
        fbs = feature_batches(docs, args.seq_per_batch, turns)
        for K in sorted({5, 7, args.block_size}):
            for anchors in sorted({16, 64, 256, 512, args.anchors}):
                for full_first in (True, False):
                    d, n, dropped, ms = measure(fbs, args.batches_per_pack, K, anchors, full_first)
                    policy = "full-first" if full_first else "uniform"
                    print(f"{'turns' if turns else 'prefix':>6} {K:>3} {anchors:>7} {policy:>11} {d:>8.4f} {n:>8} "
                          f"{dropped:>7} {ms:>8.1f}")
                    if (turns, K, anchors, full_first) == (False, args.block_size, args.anchors, True):
                        main_density = d
    print(f"packing_density={main_density:.4f} padded={padded:.4f} ratio={main_density / padded:.2f}")


if __name__ == "__main__":
    main()
