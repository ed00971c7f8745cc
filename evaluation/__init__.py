"""Offline evaluation of trained drafts by real speculative decoding against their target (no Ray, no DeepSpeed).

Modules: session (the target side of one sequence, `generate`), drafters (the Drafter contract and its adapter
for draft_model architectures), evaluate (datasets of prompts -> metrics), rounds (per-round records ->
rounds.parquet -> serving.simulator.RecordedRound streams), metrics (ECE, ROC-AUC; NumPy only, so serving/ can
use them without torch), report (report files), prompts (the built-in evaluation sets and prompt files).
This file imports nothing, so `import evaluation.metrics` stays torch-free.
"""
