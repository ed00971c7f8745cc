"""The driver's side of a run: data, target resolution, the feature service, then Ray Train + DeepSpeed.

`run_training` never branches on how it was launched (local Ray, `ray job submit`, KubeRay): the caller only
passes how to connect. Problems the user can fix (bad data, a draft that does not fit the target, a resume that
does not match the checkpoint) raise InputError before any worker starts or any checkpoint is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pipeline.config import RunConfig, save_config
from pipeline.errors import InputError
from pipeline.resume import check_resume, check_samples
from workers.target.model import resolve_target_path


class TrainingFailed(RuntimeError):
    """A trainer failed in a way no restart fixes; the message is the trainer's error, one line."""


def precheck_target(cfg: RunConfig, target_path: Path) -> None:
    """Catch a draft that cannot sit on the target from its config.json, before any worker starts."""
    config_json = target_path / "config.json"
    if not config_json.is_file():
        return  # a .gguf target: the target worker reports its dimensions once loaded
    from transformers import AutoConfig

    from workers.target.sharding import check_sharding

    tc = AutoConfig.from_pretrained(str(target_path))
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    try:
        cfg.draft.check_target(int(tc.vocab_size), int(tc.hidden_size), int(tc.num_hidden_layers))
        check_sharding(tc, cfg.target.tp_size, cfg.target.expert_parallel)
    except ValueError as e:
        raise InputError(str(e)) from e


def check_cluster_fits(cfg: RunConfig, nodes: list[dict[str, float]]) -> None:
    """InputError (one line) when the connected cluster cannot hold the target groups and trainers the config asks
    for: in total, and each group on one node (its placement group is STRICT_PACK). `nodes` holds each live node's
    total resources (ray.nodes()'s "Resources"). A cluster that grows (an autoscaler) is not foreseen here."""
    t, c = cfg.target, cfg.cluster
    group = {"GPU": t.tp_size * t.gpus_per_worker, "CPU": t.tp_size * t.cpus_per_worker}
    trainers = {"GPU": c.num_trainers * (1.0 if c.use_gpu else 0.0), "CPU": c.num_trainers * c.cpus_per_trainer}
    shape = f"target.num_workers={t.num_workers} x target.tp_size={t.tp_size}"
    for kind, per in (("GPU", "gpus_per_worker"), ("CPU", "cpus_per_worker")):
        have = sum(n.get(kind, 0.0) for n in nodes)
        need = t.num_workers * group[kind] + trainers[kind]
        if need > have + 1e-9:
            raise InputError(f"the run needs {need:g} {kind}s ({shape} x target.{per}={getattr(t, per):g}, plus "
                             f"{trainers[kind]:g} for {c.num_trainers} trainer(s)) but the Ray cluster has {have:g}")
        biggest = max((n.get(kind, 0.0) for n in nodes), default=0.0)
        if t.tp_size > 1 and group[kind] > biggest + 1e-9:
            raise InputError(f"a target group needs {group[kind]:g} {kind}s on one node (target.tp_size={t.tp_size} "
                             f"x target.{per}={getattr(t, per):g}) but the largest node has {biggest:g}")


def load_samples(cfg: RunConfig, target_path: Path) -> list:
    from pipeline.data.corpus import default_corpus, load_jsonl_corpus
    from pipeline.data.rows import load_parquet_corpus
    from workers.target.model import load_tokenizer

    tokenizer = load_tokenizer(target_path)
    try:
        if cfg.data.source == "default":
            samples = default_corpus(tokenizer, cfg.data.max_len, cfg.data.num_samples, cfg.data.seed)
        elif cfg.data.source.endswith(".parquet") or Path(cfg.data.source).is_dir():  # launch/prepare_data.py output
            samples = load_parquet_corpus(cfg.data.source, max_len=cfg.data.max_len, num_samples=cfg.data.num_samples)
        else:
            samples = load_jsonl_corpus(cfg.data.source, tokenizer, max_len=cfg.data.max_len)[:cfg.data.num_samples]
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from e
    if not samples:
        raise InputError(f"dataset {cfg.data.source!r} has no samples")
    trainable = sum(1 for s in samples if len(s.input_ids) >= 2 and s.loss_mask[1:].any())
    if trainable == 0:
        raise InputError(f"dataset {cfg.data.source!r}: none of its {len(samples)} samples has a trainable block "
                         f"(every sequence is shorter than 2 tokens or has no loss-masked token)")
    return samples


def resolve_inputs(cfg: RunConfig, log: logging.Logger) -> tuple[Path, list]:
    """The target's path and the training samples, after every check that needs no worker (InputError if bad)."""
    if cfg.data.max_len <= cfg.draft.block_size:
        raise InputError(f"data.max_len ({cfg.data.max_len}) must exceed draft.block_size ({cfg.draft.block_size}): "
                         "a sequence needs an anchor and at least one token after it")
    try:
        target_path = resolve_target_path(cfg.target.path)
    except FileNotFoundError as e:
        raise InputError(str(e)) from e
    precheck_target(cfg, target_path)
    samples = load_samples(cfg, target_path)
    log.info("data: %d samples (%s), target %s", len(samples), cfg.data.source, target_path)
    return target_path, samples


def write_run_samples(samples: list, run_dir: Path) -> tuple[Path, str]:
    """The run's samples as <run_dir>/samples.parquet (the feature service reads rows from it by id) and the
    sha256 of their tokens. A resumed run rewrites it from the same source; comparing the digest with the
    checkpoint's proves the samples did not change under the run."""
    from pipeline.sample_store import SAMPLES_FILE, samples_digest, write_samples

    return write_samples(samples, run_dir / SAMPLES_FILE), samples_digest(samples)


def run_training(cfg: RunConfig, resume_from: Path | None, connect: Callable[[], None],
                 log: logging.Logger) -> None:
    """Train to the end, or raise StoppedEarly after a stop request (SIGTERM/SIGINT on this process, or on a
    trainer: workers/run_control.py) once every trainer has checkpointed the same step."""
    import json

    import ray
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchTrainer

    from workers.preemption import StoppedEarly, stop_on_signal
    from workers.run_control import RunControl
    from workers.target.feature_service import FeatureService
    from workers.trainer.ray_trainer import train_loop
    from workers.trainer.reshard import adapt_to_checkpoint

    meta = json.loads((resume_from / "meta.json").read_text()) if resume_from is not None else None
    if meta is not None:
        try:  # another trainer count: keep the checkpoint's global batch (workers/trainer/reshard.py)
            adapt_to_checkpoint(cfg, meta, log)
        except ValueError as e:
            raise InputError(str(e)) from e
        check_resume(cfg, meta)
    target_path, samples = resolve_inputs(cfg, log)
    run_dir = Path(cfg.checkpoint.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_path, samples_digest = write_run_samples(samples, run_dir)
    if meta is not None:
        check_samples(meta, samples_digest)
    num_samples = len(samples)
    del samples  # the feature service reads them back by id; the driver need not hold the dataset

    connect()
    check_cluster_fits(cfg, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    control = RunControl.remote()
    target = {**cfg.target.__dict__, "resolved_path": str(target_path)}
    service = FeatureService.options(max_restarts=-1, max_task_retries=-1).remote(
        str(samples_path), target, list(cfg.draft.target_layers), cfg.data.samples_per_batch, cfg.data.seed,
        cfg.data.max_in_flight, cfg.data.replay_batches)
    info = ray.get(service.target_info.remote())
    try:
        cfg.draft = cfg.draft.resolved_for_target(info["vocab_size"], info["hidden_size"], info["num_layers"])
    except ValueError as e:
        raise InputError(str(e)) from e
    (weights_ref,) = ray.get(service.embedding_weights.remote())

    save_config(cfg, run_dir / "config.yaml")
    log.info("training %s draft (%d layers, ffn %s, residual %s, window %d, gamma %d, head %s) for %d steps on %d "
             "trainer(s); %s", cfg.draft.arch, cfg.draft.num_layers, cfg.draft.ffn, cfg.draft.residual,
             cfg.draft.sliding_window, cfg.draft.block_size, cfg.draft.head, cfg.train.max_steps,
             cfg.cluster.num_trainers, f"resuming from {resume_from}" if resume_from else "fresh start")

    resources = {"CPU": cfg.cluster.cpus_per_trainer, **cfg.cluster.resources_per_trainer}
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.to_dict(), "service": service, "control": control,
                           "weights_ref": weights_ref, "num_samples": num_samples, "samples_digest": samples_digest},
        scaling_config=ScalingConfig(num_workers=cfg.cluster.num_trainers, use_gpu=cfg.cluster.use_gpu,
                                     resources_per_worker=resources),
        run_config=RayRunConfig(storage_path=str(run_dir / "ray_train"), name="train",
                                failure_config=FailureConfig(max_failures=cfg.cluster.max_failures)),
    )
    try:
        with stop_on_signal(lambda name: control.request_stop.remote(name)):
            trainer.fit()
        fatal, reason = ray.get([control.fatal_error.remote(), control.stop_reason.remote()])
        if fatal is not None:  # the retried trainer group returned at once (workers/trainer/ray_trainer.train_loop)
            raise TrainingFailed(fatal)
    finally:
        ray.get(service.shutdown.remote())
        ray.kill(service, no_restart=True)
    if reason is not None:
        from workers.trainer.checkpoint import CheckpointManager

        # the trainers verified and wrote it just now: sizes are enough to find its step
        latest = CheckpointManager(run_dir, cfg.checkpoint.keep_last).latest(verify="size")
        step = int(json.loads((latest / "meta.json").read_text())["step"]) if latest else 0
        if step < cfg.train.max_steps:  # else the request came during the last step: the run is complete
            raise StoppedEarly(step, cfg.train.max_steps)


def root_cause(e: BaseException) -> str:
    """The innermost exception of a Ray/Train failure chain, as 'Type: message' (first line only)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "cause", None) or e.__cause__
        if isinstance(inner, BaseException):
            e = inner
            continue
        break
    text = str(e).strip().splitlines()
    msg = next((ln for ln in reversed(text) if ln.strip() and not ln.startswith(" ")), "") if text else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
