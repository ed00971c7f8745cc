"""What a run trains on, resolved on the driver before any worker starts: the target's path (checked against the
draft from its config.json), the training samples from data.source (the embedded default corpus, a prepared
Parquet directory, or a JSONL file) and the run's samples file. Shared by the Ray driver (workers/driver.py) and
the single-process trainer; every problem the user can fix is an InputError.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import InputError
from workers.frozen_target.model import resolve_target_path
from workers.frozen_target.target_files import check_target_files


def precheck_target(cfg: RunConfig, target_path: Path) -> None:
    """Catch a draft that cannot sit on the target from its config.json, before any worker starts."""
    config_json = target_path / "config.json"
    if not config_json.is_file():
        return  # a .gguf target: the target worker reports its dimensions once loaded
    from transformers import AutoConfig

    from workers.frozen_target.sharding import check_sharding

    tc = AutoConfig.from_pretrained(str(target_path))
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    try:
        cfg.draft.check_target(int(tc.vocab_size), int(tc.hidden_size), int(tc.num_hidden_layers))
        if cfg.target.backend == "transformers":  # vLLM shards the target itself (its own checks, at load)
            check_sharding(tc, cfg.target.tp_size, cfg.target.expert_parallel)
    except ValueError as e:
        raise InputError(str(e)) from e


def load_samples(cfg: RunConfig, target_path: Path, tokenizer=None, in_memory: bool = True):
    """The run's samples: a list of TokenizedSample, or with `in_memory=False` and a data-stage Parquet source, a
    ParquetSamples that the driver streams into the run's samples file without holding the data set."""
    from pipeline.data.corpus import default_corpus, load_jsonl_corpus
    from pipeline.data.parquet_source import ParquetSamples, load_parquet_corpus
    from workers.frozen_target.model import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_path)
    try:
        if cfg.data.source == "default":
            samples = default_corpus(tokenizer, cfg.data.max_len, cfg.data.num_samples, cfg.data.seed)
        elif cfg.data.source.endswith(".parquet") or Path(cfg.data.source).is_dir():  # launch/prepare_data.py output
            load = load_parquet_corpus if in_memory else ParquetSamples
            samples = load(cfg.data.source, max_len=cfg.data.max_len, num_samples=cfg.data.num_samples)
        else:
            samples = load_jsonl_corpus(cfg.data.source, tokenizer, max_len=cfg.data.max_len,
                                        num_samples=cfg.data.num_samples)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from e
    if not len(samples):
        raise InputError(f"dataset {cfg.data.source!r} has no samples")
    trainable = samples.trainable if isinstance(samples, ParquetSamples) else sum(
        1 for s in samples if len(s.input_ids) >= 2 and s.loss_mask[1:].any())
    if trainable == 0:
        raise InputError(f"dataset {cfg.data.source!r}: none of its {len(samples)} samples has a trainable block "
                         f"(every sequence is shorter than 2 tokens or has no loss-masked token)")
    return samples


def resolve_inputs(cfg: RunConfig, log: logging.Logger, in_memory: bool = True) -> tuple[Path, Any]:
    """The target's path and the training samples, after every check that needs no worker (InputError if bad).
    `in_memory=False` (the Ray driver): a data-stage source stays on disk (see load_samples)."""
    try:
        target_path = resolve_target_path(cfg.target.path)
    except FileNotFoundError as e:
        raise InputError(str(e)) from e
    check_target_files(target_path)  # every file of it, before a worker meets a damaged one
    precheck_target(cfg, target_path)
    from workers.frozen_target.model import load_tokenizer

    tokenizer = load_tokenizer(target_path)
    samples = load_samples(cfg, target_path, tokenizer, in_memory)
    log.info("data: %d samples (%s), target %s", len(samples), cfg.data.source, target_path)
    resolve_mask_token(cfg, tokenizer, samples, log)
    return target_path, samples


def resolve_mask_token(cfg: RunConfig, tokenizer, samples, log: logging.Logger) -> None:
    """draft.mask=token: choose the id when it is -1, then check it against the template and the data."""
    if cfg.draft.mask != "token":
        return
    from pipeline.mask_token import check_mask_token, choose_mask_token

    try:
        if cfg.draft.mask_token_id < 0:
            cfg.draft.mask_token_id = choose_mask_token(tokenizer)
            log.info("draft.mask_token_id: %d (%r), a token the chat template and the data never use",
                     cfg.draft.mask_token_id, tokenizer.convert_ids_to_tokens(cfg.draft.mask_token_id))
        check_mask_token(cfg.draft.mask_token_id, tokenizer, samples)
    except ValueError as e:
        raise InputError(str(e)) from e


def write_run_samples(samples, run_dir: Path) -> tuple[Path, str]:
    """The run's samples as <run_dir>/samples.parquet (the feature service reads rows from it by id) and the
    sha256 of their tokens. A resumed run rewrites it from the same source; comparing the digest with the
    checkpoint's proves the samples did not change under the run. `samples` is a list or a ParquetSamples (read
    a batch of rows at a time); the digest is computed as the rows are written."""
    from pipeline.sample_store import SAMPLES_FILE, SamplesWriter, list_chunks

    chunks = list_chunks(samples) if isinstance(samples, list) else samples.chunks()
    with SamplesWriter(run_dir / SAMPLES_FILE) as writer:
        for chunk in chunks:
            writer.write(*chunk)
    return writer.path, writer.digest
