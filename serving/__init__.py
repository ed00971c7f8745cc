"""Serving side of DSpark (DESIGN.md §3): STS calibration, the SPS cost table, scheduling policies, a replay
simulator. Pure NumPy (torch tensors are accepted where they convert); never imports ray, deepspeed or
torch.distributed.

Modules: calibration (sequential temperature scaling, calibration.json), metrics (ECE, ROC-AUC), sps
(steps-per-second table), policies (static γ, threshold, Algorithm 1, the asynchronous variant), simulator
(replay of recorded rounds).
"""
