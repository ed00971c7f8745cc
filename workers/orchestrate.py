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
from pipeline.target_model import resolve_target_path


class InputError(ValueError):
    """Bad input the user can fix; reported as one line, exit status 2."""


def precheck_target(cfg: RunConfig, target_path: Path) -> None:
    """Catch a draft that cannot sit on the target from its config.json, before any worker starts."""
    config_json = target_path / "config.json"
    if not config_json.is_file():
        return  # a .gguf target: the target worker reports its dimensions once loaded
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(target_path))
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    try:
        cfg.draft.check_target(int(tc.vocab_size), int(tc.hidden_size), int(tc.num_hidden_layers))
    except ValueError as e:
        raise InputError(str(e)) from e


def load_samples(cfg: RunConfig, target_path: Path) -> list:
    from pipeline.corpus import default_corpus, load_jsonl_corpus
    from pipeline.data_stage import load_parquet_corpus
    from pipeline.target_model import load_tokenizer

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


def check_resume(cfg: RunConfig, meta: dict) -> None:
    """A resume must replay the same data order with the same model; say which setting differs."""
    saved = meta.get("config", {})
    now = cfg.to_dict()
    keys = [("draft", None), ("data", "samples_per_batch"), ("data", "seed"), ("data", "num_samples"),
            ("data", "source"), ("target", "path")]
    for section, key in keys:
        a = saved.get(section, {}) if key is None else saved.get(section, {}).get(key)
        b = now[section] if key is None else now[section][key]
        if key is None:  # the draft section is compared after target resolution fills vocab/hidden
            a = {k: v for k, v in a.items() if k not in ("vocab_size", "hidden_size")}
            b = {k: v for k, v in b.items() if k not in ("vocab_size", "hidden_size")}
        if a != b:
            name = section if key is None else f"{section}.{key}"
            raise InputError(f"cannot resume: {name} is {b!r} now but {a!r} in the checkpoint (the same model and "
                             "data order are needed; use a new --run-dir to start over)")
    # the global batch (feature batches per step), not its split into trainers x grad_accum (workers/reshard.py)
    a = saved.get("train", {}).get("grad_accum", 1) * saved.get("cluster", {}).get("num_trainers", 1)
    b = cfg.train.grad_accum * cfg.cluster.num_trainers
    if a != b:
        raise InputError(f"cannot resume: train.grad_accum x cluster.num_trainers is {b} now but {a} in the "
                         "checkpoint (the same global batch is needed; use a new --run-dir to start over)")


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


def run_training(cfg: RunConfig, resume_from: Path | None, connect: Callable[[], None],
                 log: logging.Logger) -> None:
    import json

    import ray
    from ray.train import RunConfig as RayRunConfig
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from workers.feature_service import FeatureService
    from workers.reshard import adapt_to_checkpoint
    from workers.trainer import train_loop

    if resume_from is not None:
        meta = json.loads((resume_from / "meta.json").read_text())
        try:  # another trainer count: keep the checkpoint's global batch (workers/reshard.py)
            adapt_to_checkpoint(cfg, meta, log)
        except ValueError as e:
            raise InputError(str(e)) from e
        check_resume(cfg, meta)
    target_path, samples = resolve_inputs(cfg, log)

    connect()
    target = {**cfg.target.__dict__, "resolved_path": str(target_path)}
    service = FeatureService.remote(samples, target, list(cfg.draft.target_layers), cfg.data.samples_per_batch,
                                    cfg.data.seed, cfg.data.max_in_flight, cfg.data.replay_batches)
    info = ray.get(service.target_info.remote())
    try:
        cfg.draft = cfg.draft.resolved_for_target(info["vocab_size"], info["hidden_size"], info["num_layers"])
    except ValueError as e:
        raise InputError(str(e)) from e
    (weights_ref,) = ray.get(service.embedding_weights.remote())

    run_dir = Path(cfg.checkpoint.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    log.info("training %s draft (%d layers, ffn %s, residual %s, window %d, gamma %d, head %s) for %d steps on %d "
             "trainer(s); %s", cfg.draft.arch, cfg.draft.num_layers, cfg.draft.ffn, cfg.draft.residual,
             cfg.draft.sliding_window, cfg.draft.block_size, cfg.draft.head, cfg.train.max_steps,
             cfg.cluster.num_trainers, f"resuming from {resume_from}" if resume_from else "fresh start")

    resources = {"CPU": cfg.cluster.cpus_per_trainer, **cfg.cluster.resources_per_trainer}
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.to_dict(), "service": service, "weights_ref": weights_ref,
                           "num_samples": len(samples),
                           "resume_from": str(resume_from) if resume_from else None},
        scaling_config=ScalingConfig(num_workers=cfg.cluster.num_trainers, use_gpu=cfg.cluster.use_gpu,
                                     resources_per_worker=resources),
        run_config=RayRunConfig(storage_path=str(run_dir / "ray_train"), name="train"),
    )
    try:
        trainer.fit()
    finally:
        ray.get(service.shutdown.remote())
        ray.kill(service)


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
