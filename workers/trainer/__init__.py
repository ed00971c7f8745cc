"""The draft trainers: the Ray Train + DeepSpeed trainer (ray_trainer) and the single-process one (single_process),
two assemblies of one loop (loop) and one optimizer step (step), with their engines, checkpoints (checkpoint),
the sample ledger (ledger) and elastic resharding (reshard)."""
