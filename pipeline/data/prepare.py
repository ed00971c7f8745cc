"""The resumable data-stage run: input records -> shards of rows (pipeline/data/rows.py) -> an output directory.

Layout and guarantees are described in pipeline/data/rows.py. Here: the run fingerprint (everything that changes
the rows: inputs' content, tokenizer and template, max_len, generation params, batch and shard size, the target),
the per-shard loop, atomic writes, progress.json and stats.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.atomic import write_text_atomic
from pipeline.data.regenerate import GenParams, ReplyGenerator
from pipeline.data.rows import FORMAT_VERSION, KEPT_UNFINISHED, REASONS, build_shard, file_digest, open_prompts

log = logging.getLogger(__name__)

PROGRESS = "progress.json"
STATS = "stats.json"


def fingerprint(inputs: list[str], dataset, tokenizer, max_len: int, params: GenParams | None, batch_size: int,
                shard_size: int, target: str | None) -> dict:
    """What the rows depend on; a resume with a different fingerprint would mix two datasets."""
    sources = []
    for p in inputs:
        sources.append({"path": str(Path(p).resolve()), "sha256": file_digest(p)} if Path(p).is_file()
                       else {"name": p, "datasets_fingerprint": getattr(dataset, "_fingerprint", None)})
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "format_version": FORMAT_VERSION,
        "inputs": sources,
        "num_records": len(dataset),
        "tokenizer": {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "vocab_size": len(tokenizer),
                      "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()},
        "max_len": max_len,
        "regenerate": params.to_dict() if params else None,
        # Batches decide the sampled tokens (regenerate.py), shards decide which rows share a batch.
        "batch_size": batch_size if params else None,
        "shard_size": shard_size,
        "target": target if params else None,
    }


def summarize(completed: dict) -> dict:
    """Totals over completed shards: records read, rows written, tokens, and the drops by reason."""
    dropped = Counter()
    for entry in completed.values():
        dropped.update(entry["dropped"])
    return {
        "records": sum(e["records"] for e in completed.values()),
        "rows": sum(e["rows"] for e in completed.values()),
        "tokens": sum(e["tokens"] for e in completed.values()),
        "trained_tokens": sum(e["trained_tokens"] for e in completed.values()),
        "dropped": {r: dropped.get(r, 0) for r in REASONS},
        "dropped_total": sum(dropped.get(r, 0) for r in REASONS),
        "unfinished_kept": dropped.get(KEPT_UNFINISHED, 0),  # replies cut at max_new_tokens, kept as cut
    }


def commit_shard(out: Path, state: dict, key: str, table: pa.Table, records: int, dropped: Counter) -> None:
    """Write shard `key`'s rows (rows.SCHEMA) to a temp name, rename it into place, then name it in progress.json
    (replaced atomically) with its counts."""
    name = f"part-{key}.parquet"
    tmp = out / (name + ".tmp")
    pq.write_table(table, tmp, compression="zstd", compression_level=3)
    os.replace(tmp, out / name)
    tokens = pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0
    trained = pc.sum(pc.list_flatten(table.column("loss_mask"))).as_py() or 0
    state["completed"][key] = {"file": name, "records": records, "rows": len(table), "tokens": tokens,
                               "trained_tokens": trained, "dropped": dict(dropped)}
    state["complete"] = len(state["completed"]) == state["num_shards"]
    write_text_atomic(out / PROGRESS, json.dumps(state, indent=1))


def finish(out: Path, state: dict, max_len: int) -> dict:
    """Mark the run complete in progress.json and write stats.json; returns the stats."""
    state["complete"] = True
    write_text_atomic(out / PROGRESS, json.dumps(state, indent=1))
    stats = {**summarize(state["completed"]), "shards": state["num_shards"], "max_len": max_len,
             "regenerate": state["fingerprint"]["regenerate"]}
    write_text_atomic(out / STATS, json.dumps(stats, indent=1))
    return stats


def run_data_stage(inputs: list[str], tokenizer, out_dir: str | os.PathLike, *, max_len: int = 1024,
                   params: GenParams | None = None, generator: ReplyGenerator | None = None, batch_size: int = 8,
                   shard_size: int = 256, target: str | None = None, split: str = "train",
                   progress_bar: bool = False) -> dict:
    """Write (or finish writing) the data-stage output for `inputs` into `out_dir`; returns the stats.

    Regenerates the replies when `params` and `generator` are given. Rerunning with the same arguments after a
    crash resumes at the first unfinished shard; with different ones it raises ValueError.
    """
    if max_len < 2 or batch_size < 1 or shard_size < 1:
        raise ValueError(f"need max_len >= 2, batch_size >= 1, shard_size >= 1; got {max_len}, {batch_size}, "
                         f"{shard_size}")
    if (params is None) != (generator is None):
        raise ValueError("regeneration needs both generation params and a generator")
    dataset = open_prompts(inputs, split=split)
    if len(dataset) == 0:
        raise ValueError(f"inputs {inputs} have no records")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(inputs, dataset, tokenizer, max_len, params, batch_size, shard_size, target)
    num_shards = -(-len(dataset) // shard_size)
    state = {"fingerprint": fp, "num_shards": num_shards, "completed": {}, "complete": False}
    if (out / PROGRESS).exists():
        saved = json.loads((out / PROGRESS).read_text())
        if saved["fingerprint"] != fp:
            diff = sorted(k for k in fp if fp[k] != saved["fingerprint"].get(k))
            raise ValueError(f"{out} holds data-stage output made with different settings ({', '.join(diff)}); "
                             "use another output directory or delete it")
        state = saved
        if state["completed"]:
            log.info("resuming in %s: %d of %d shards done", out, len(state["completed"]), num_shards)
    # Leftovers of a killed run (a shard renamed into place before progress.json named it, temp files) are
    # redone from scratch: the same settings give the same rows.
    done_files = {e["file"] for e in state["completed"].values()}
    for f in list(out.glob("part-*.parquet*")):
        if f.name not in done_files:
            f.unlink()

    from tqdm import tqdm

    done_records = sum(e["records"] for e in state["completed"].values())
    bar = tqdm(total=len(dataset), initial=done_records, unit="rec", disable=not progress_bar, desc="data stage")
    try:
        for s in range(num_shards):
            key = f"{s:05d}"
            if key in state["completed"]:
                continue
            lo, hi = s * shard_size, min((s + 1) * shard_size, len(dataset))
            records = dataset[lo:hi]  # a dict of columns
            records = [dict(zip(records, values)) for values in zip(*records.values())]
            shown = 0  # records of this shard the bar counts as done so far

            def advance(done: int, total: int, lo=lo, hi=hi) -> None:
                # batches are of rows, the bar is of records: a shard's records are spread evenly over its batches
                nonlocal shown
                now = (hi - lo) * done // total
                bar.update(now - shown)
                shown = now

            table, dropped = build_shard(records, lo, tokenizer, max_len, params, generator, batch_size,
                                         progress=advance)
            commit_shard(out, state, key, table, hi - lo, dropped)
            bar.update(hi - lo - shown)
            stats = summarize(state["completed"])
            bar.set_postfix(rows=stats["rows"], dropped=stats["dropped_total"])
    finally:
        bar.close()
    stats = finish(out, state, max_len)
    if stats["dropped_total"]:
        log.warning("data stage: dropped %d of the candidate rows: %s", stats["dropped_total"],
                    {k: v for k, v in stats["dropped"].items() if v})
    return stats
