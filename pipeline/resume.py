"""What a resume may change: the policy that a resumed run continues the same model on the same data order.

`check_resume(cfg, meta)` compares the run's config with the checkpoint's (meta.json) and refuses, naming the
setting and both values, any difference outside RESUMABLE_CHANGES (an `auto` compute dtype keeps the checkpoint's
resolved value: `kept_choice`); `check_samples` compares the training samples'
digest with the checkpoint's. Both raise InputError (exit status 2) before any worker starts. Used by the driver
(workers/driver.py) and the single-process trainer alike; docs/fault-tolerance.md, "What a resume may change".
"""

from __future__ import annotations

from pipeline.config import RunConfig
from pipeline.errors import InputError

# Settings a resume may change: how long the run goes, how it reports and saves, where its processes run, and
# implementation choices proven to compute the same thing. Every other setting changes the data or the model and
# must equal the checkpoint's (docs/fault-tolerance.md, "What a resume may change"). A dotted prefix allows a
# whole subtree.
RESUMABLE_CHANGES = (
    "train.max_steps",  # train longer: both engines stretch the cosine to the new total from the restored step
    "train.log_every", "train.tensorboard",
    "train.compile",  # the same numbers as eager (tests/test_trainer_step.py); speed only
    "checkpoint",  # cadence, retention, export; run_dir too: a moved run dir, the checkpoint is found inside it
    "cluster.address", "cluster.cpus_per_trainer", "cluster.use_gpu", "cluster.resources_per_trainer",
    "cluster.local_num_cpus", "cluster.max_failures", "cluster.dashboard_host", "cluster.min_trainers",
    "cluster.elastic_resize_s",
    "target.max_restarts", "target.batch_timeout_s",  # how failures are retried and waited for
    "target.num_workers", "target.cpus_per_worker", "target.gpus_per_worker", "target.resources_per_worker",
    "target.device_map", "target.max_tokens_per_forward",  # placement and forward chunking: same features
    # sharding: the same features to ~1e-6 in fp32 (tests/test_target_group.py), not bit for bit
    "target.tp_size", "target.expert_parallel",
    # the engine: vLLM's features equal transformers' to ~2e-6 in fp32 (tests/test_vllm_target.py), and its own
    # parallelism, environment and hand-off change where they are computed, not what they are
    "target.backend", "target.pp_size", "target.vllm_python", "target.vllm_executor", "target.vllm_enforce_eager",
    "target.vllm_transport", "target.vllm_kv_cache_gib",
    "data.max_in_flight",  # the prefetch bound, not the order
    "data.feature_cache",  # the features the target shipped, stored (workers/frozen_target/feature_cache.py)
    "loss.chunk_rows",  # the same sum over other chunks: memory and speed only
    "draft.attn_impl",  # packed and gather agree to 1e-5 (tests/test_attention_paths.py)
)
# Owned by elastic resume (workers/trainer/reshard.py): only the product, the global batch, must stay.
GLOBAL_BATCH = ("train.grad_accum", "cluster.num_trainers")
FILLED_FROM_TARGET = ("draft.vocab_size", "draft.hidden_size")  # 0 in the config until the target is resolved
CHOSEN_AT_LAUNCH = ("draft.mask_token_id",)  # -1 = choose at launch (pipeline/mask_token.py); an explicit id must match
# `auto` compute dtypes, resolved by the trainer from its own device (draft_model/precision.py) and saved resolved in
# every checkpoint's config: a resume with `auto` keeps the checkpoint's value (`kept_choice`), so a run never
# changes its numerics because it landed on another machine; an explicit value must match. The value is what a
# checkpoint from before `auto` ran with when its config lacks the key (its default then).
RESOLVED_ON_TRAINER = {"loss.matmul_dtype": "bfloat16"}


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + ".") if isinstance(v, dict) and v else {name: v})
    return out


def _allowed(name: str) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in RESUMABLE_CHANGES for i in range(1, len(parts) + 1))


def check_resume(cfg: RunConfig, meta: dict) -> None:
    """A resume must continue the same model on the same data order: refuse, naming the setting and both values,
    any difference outside RESUMABLE_CHANGES. A key the checkpoint's config lacks (it predates the key) is
    compared with the key's default, which by convention is the behaviour of the code before it existed."""
    saved, now = _flatten(meta.get("config", {})), _flatten(cfg.to_dict())
    default = _flatten(RunConfig().to_dict())
    hint = "the same model and data order are needed; use a new --run-dir to start over"
    (ga_a, nt_a), (ga_b, nt_b) = [[int(x.get(k, default[k])) for k in GLOBAL_BATCH] for x in (saved, now)]
    if ga_a * nt_a != ga_b * nt_b:
        raise InputError(f"cannot resume: the global batch (train.grad_accum x cluster.num_trainers) is {ga_b * nt_b}"
                         f" feature batches per step now ({ga_b} x {nt_b}) but {ga_a * nt_a} in the checkpoint "
                         f"({ga_a} x {nt_a}); a resume may regroup the global batch, not resize it ({hint})")
    for name, value in now.items():
        if _allowed(name) or name in GLOBAL_BATCH or name in FILLED_FROM_TARGET:
            continue
        if name in CHOSEN_AT_LAUNCH and value == -1:  # chosen again, the same way, then checked like the data
            continue
        if name in RESOLVED_ON_TRAINER and value == "auto":  # the trainer keeps the checkpoint's choice
            continue
        old = saved.get(name, RESOLVED_ON_TRAINER.get(name, default.get(name)))
        if old != value:
            raise InputError(f"cannot resume: {name} is {value!r} now but {old!r} in the checkpoint (pass "
                             f"{name}={old} to continue this run; {hint})")


def kept_choice(meta: dict, name: str) -> str:
    """The value of an `auto` setting (RESOLVED_ON_TRAINER) that a run resumed from the checkpoint of `meta` keeps:
    the one its run resolved and saved."""
    section, key = name.split(".")
    return meta.get("config", {}).get(section, {}).get(key, RESOLVED_ON_TRAINER[name])


def check_samples(meta: dict, samples_digest: str) -> None:
    """A resume must train on the same token sequences: the checkpoint records the sha256 of their tokens."""
    saved = meta.get("data_position", {}).get("samples_digest")
    if saved and saved != samples_digest:
        raise InputError(f"cannot resume: the training samples differ from the checkpoint's (sha256 "
                         f"{samples_digest[:12]} now, {saved[:12]} there): data.source changed on disk; use a new "
                         "--run-dir to start over")
