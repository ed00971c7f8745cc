"""Offline evaluation of trained drafts by real speculative decoding against their target (no Ray, no DeepSpeed).

Modules: session (the target side of one sequence, `generate`), drafters (the Drafter contract and its adapter
for draft_model architectures), evaluate (datasets of prompts -> metrics), rounds (per-round records ->
rounds.parquet -> serving.simulator.RecordedRound streams), report (report files), prompts (the built-in
evaluation sets and prompt files). ECE and ROC-AUC are serving.metrics: serving/ calibrates with them and sits
below evaluation/, which imports it.
"""
