"""Regeneration throughput: SmolLM2-135M-Instruct answering 8 prompts, one prompt per generate call vs one batch.

Run: python bench/regenerate_throughput.py [--max-new-tokens 64] [--batch-sizes 1 8] [--device cpu]

Batch size 1 seeds every row by its own id (output independent of the other rows); larger batches are faster but
a row's sample depends on which rows share its batch (pipeline/data/regenerate.py). Prints one line per batch size.
"""

from __future__ import annotations

import argparse
import time

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence.",
           "Give three uses of a paperclip.", "What is 17 times 3?", "Name a famous painter and one of their works.",
           "How do I reverse a list in Python?", "Why is the sky blue?"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import torch

    from pipeline.data.chat import render_prompt
    from pipeline.data.regenerate import GenParams, batch_seed
    from workers.frozen_target.generation import generate_batch
    from workers.frozen_target.model import load_target, smollm2_path

    model, tok = load_target(smollm2_path())
    model.to(args.device)
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in PROMPTS]
    params = GenParams(temperature=0.8, top_p=0.95, max_new_tokens=args.max_new_tokens)
    generate_batch(model, tok, prompts[:2], params, 0)  # warm-up
    print(f"torch threads {torch.get_num_threads()}, device {args.device}, {len(prompts)} prompts, "
          f"max_new_tokens {args.max_new_tokens}")
    for bs in args.batch_sizes:
        t0 = time.perf_counter()
        gens = []
        for s in range(0, len(prompts), bs):
            gens += generate_batch(model, tok, prompts[s:s + bs], params, batch_seed(0, f"{s}-1"))
        dt = time.perf_counter() - t0
        new = sum(len(g.token_ids) for g in gens)
        print(f"batch {bs}: {dt:6.1f} s | {new} new tokens | {new / dt:6.1f} tok/s | "
              f"{sum(g.finished for g in gens)}/{len(gens)} finished")


if __name__ == "__main__":
    main()
