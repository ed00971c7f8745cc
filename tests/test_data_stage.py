"""Data stage: per-turn rows + loss masks (golden, real SmolLM2 tokenizer), bad-row accounting, regeneration by a
tiny random target, resume after a kill (identical output, no duplicates), zstd Parquet, the training loader.

Run: python -m pytest tests/test_data_stage.py -q          (the SIGKILL and Ray tests: add -m slow)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.data.chat import render_prompt
from pipeline.data.parquet_source import load_parquet_corpus
from pipeline.data.prepare import run_data_stage
from pipeline.data.regenerate import Generation, GenParams
from pipeline.data.rows import build_shard, normalize_record
from workers.frozen_target import model as tm
from workers.frozen_target.generation import LocalGenerator, generate_batch

REPO = Path(__file__).resolve().parents[1]
CONVERSATION = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5."},
                {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "20"}]
# Same golden rendering as tests/test_corpus.py: the whole conversation is 64 tokens, the first turn ends at 46.
GOLDEN_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 35, 47, 2, 198, 1, 520, 9531, 198, 34, 27, 35, 446,
              216, 37, 30, 2, 198, 1, 4093, 198, 3528, 1711, 216, 36, 47, 2, 198, 1, 520, 9531, 198, 34, 32, 2, 198]
EOS = 2  # <|im_end|>: SmolLM2's end of turn and eos
PARAMS = GenParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=3)


@pytest.fixture(scope="module")
def tok():
    return tm.smollm2_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tok, tmp_path_factory):
    """A tiny random target whose generation config favours <|im_end|> (a bias of +9 on ~49k near-uniform
    logits: it stops after a few tokens, sometimes at once), so replies finish within a few tokens."""
    model, _ = tm.tiny_moe_target("qwen3_moe", seed=0, tokenizer=tok)
    model.generation_config.sequence_bias = [[[EOS], 9.0]]
    return tm.save_target(model, tok, tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tm.load_target(tiny_dir)


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


# ---- rendering -----------------------------------------------------------------------------------------------


def test_two_turn_conversation_gives_two_rows_each_training_its_last_turn(tok):
    table, bad = build_shard([{"messages": CONVERSATION}], 7, tok, max_len=1024)
    assert not bad
    rows = table.to_pylist()
    assert [r["row_id"] for r in rows] == ["7-1", "7-3"] and [r["turn_index"] for r in rows] == [1, 3]
    first, second = rows
    assert first["input_ids"] == GOLDEN_IDS[:46] and second["input_ids"] == GOLDEN_IDS
    assert np.nonzero(first["loss_mask"])[0].tolist() == list(range(37, 45))  # "2+3 = 5." <|im_end|>
    assert np.nonzero(second["loss_mask"])[0].tolist() == [60, 61, 62]  # "20" <|im_end|>; turn 1 is context only
    assert json.loads(second["prompt"]) == CONVERSATION[:3] and second["response"] == "20"
    assert json.loads(first["prompt"]) == CONVERSATION[:1] and not first["regenerated"] and first["generation"] is None


def test_record_layouts_normalize_to_messages():
    want = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert normalize_record({"messages": want}) == want
    assert normalize_record({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}) == want
    assert normalize_record({"prompt": "Q", "response": "A"}) == want
    assert normalize_record({"prompt": "Q", "completion": "A", "response": None}) == want
    assert normalize_record({"prompt": "Q"}) == want[:1]


# ---- bad rows --------------------------------------------------------------------------------------------------


BAD_RECORDS = [
    {"messages": CONVERSATION},  # 0: two rows
    {"messages": [{"role": "user", "content": "hi"}]},  # 1: no assistant turn
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "},  # 2: empty turn: both
                  {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},  # rows dropped
    {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},  # 3: empty prompt
    {"messages": [{"role": "robot", "content": "hi"}]},  # 4: malformed
    {"text": "plain text is not a conversation"},  # 5: malformed
    {"prompt": "Count.", "response": " ".join(str(i) for i in range(60))},  # 6: too long for max_len 64
    {"prompt": "Name a color.", "response": "Blue."},  # 7: one row
]


def test_bad_rows_are_counted_and_reported(tok, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", BAD_RECORDS)
    stats = run_data_stage([str(src)], tok, tmp_path / "out", max_len=64, shard_size=3)
    assert [r["row_id"] for r in _rows(tmp_path / "out")] == ["0-1", "0-3", "7-1"]
    want = {"malformed_record": 2, "empty_prompt": 1, "no_assistant_turn": 1, "empty_assistant_turn": 2,
            "too_long": 1, "generation_failed": 0, "generation_unfinished": 0, "empty_generation": 0}
    assert stats["dropped"] == want and stats["dropped_total"] == 7
    assert stats["records"] == 8 and stats["rows"] == 3 and stats["shards"] == 3
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["dropped"] == want
    assert stats["tokens"] == 64 + 46 + len(_rows(tmp_path / "out")[2]["input_ids"]) and stats["trained_tokens"] == 14


class ScriptedGenerator:
    """Answers batch k with script[k]: a list of Generations or an exception."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def __call__(self, batches, params):
        self.calls.append([len(p) for _, p in batches])
        return [self.script.pop(0) for _ in batches]


def test_generation_failures_are_counted(tok):
    records = [{"prompt": f"q{i}"} for i in range(7)]
    gen = ScriptedGenerator([
        [Generation([520, EOS], True), Generation([EOS], True)],  # ok, empty
        RuntimeError("CUDA out of memory"),  # both rows of this batch failed
        [Generation([520, 30], False), Generation([198, 216, EOS], True)],  # unfinished, whitespace-only
        [Generation([30, EOS], True)],
    ])
    table, bad = build_shard(records, 0, tok, max_len=64, params=PARAMS, generator=gen, batch_size=2)
    assert gen.calls == [[2, 2, 2, 1]]
    assert table.column("row_id").to_pylist() == ["0-1", "6-1"]
    assert dict(bad) == {"empty_generation": 2, "generation_failed": 2, "generation_unfinished": 1}
    assert table.column("input_ids").to_pylist()[0][-2:] == [520, EOS]
    with pytest.raises(RuntimeError, match="every generation batch of this shard failed"):
        build_shard(records[:2], 0, tok, max_len=64, params=PARAMS, generator=ScriptedGenerator([ValueError("x")]),
                    batch_size=2)



def test_progress_is_counted_as_each_batch_comes_back(tok, tmp_path, monkeypatch):
    """A generator that hands its batches over one by one is seen batch by batch: the progress callback runs
    between one batch and the next, and the data stage's bar moves within a shard instead of once per shard."""
    events = []

    def lazy(batches, params):
        for k, (_, prompts) in enumerate(batches):
            events.append(f"generated {k}")
            yield [Generation([520, EOS], True) for _ in prompts]

    records = [{"prompt": f"q{i}"} for i in range(5)]
    table, bad = build_shard(records, 0, tok, max_len=64, params=PARAMS, generator=lazy, batch_size=2,
                             progress=lambda done, total: events.append(f"progress {done}/{total}"))
    assert len(table) == 5 and not bad
    assert events == ["generated 0", "progress 1/3", "generated 1", "progress 2/3", "generated 2", "progress 3/3"]

    import tqdm

    class Bar:  # records what the stage tells its bar
        moves: list = []

        def __init__(self, *a, initial=0, **kw):
            self.moves.append(("start", initial))

        def update(self, n):
            self.moves.append(n)

        def set_postfix(self, **kw):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    src = _write_jsonl(tmp_path / "in.jsonl", records + [{"prompt": "q5"}])
    run_data_stage([str(src)], tok, tmp_path / "out", max_len=64, params=PARAMS, generator=lazy, batch_size=2,
                   shard_size=5, target="scripted", progress_bar=True)
    # shard 0: 5 records over 3 batches (1, 3, 5 records done), then 0 at its commit; shard 1: 1 record, 1 batch
    assert Bar.moves == [("start", 0), 1, 2, 2, 0, 1, 0]


def test_cut_replies_are_kept_as_cut_only_when_asked(tok, tmp_path):
    """--keep-unfinished: a reply cut at max_new_tokens becomes a row of exactly the tokens the target generated (no
    stop token appended, all of them trained), counted as unfinished_kept and not as a drop; without it the row is
    dropped as before, and a stage fingerprinted before the option existed still resumes (to_dict leaves it out)."""
    cut, done = Generation([520, 30, 198], False), Generation([520, EOS], True)
    keep = GenParams(temperature=1.0, top_p=0.9, max_new_tokens=3, seed=3, keep_unfinished=True)
    table, bad = build_shard([{"prompt": "a"}, {"prompt": "b"}], 0, tok, max_len=64, params=keep,
                             generator=ScriptedGenerator([[cut, done]]), batch_size=2)
    rows = table.to_pylist()
    assert [r["row_id"] for r in rows] == ["0-1", "1-1"] and dict(bad) == {"unfinished_kept": 1}
    p_ids = render_prompt(tok, [{"role": "user", "content": "a"}])
    assert rows[0]["input_ids"] == p_ids + [520, 30, 198]
    assert rows[0]["loss_mask"] == [False] * len(p_ids) + [True] * 3
    assert rows[0]["response"] == tok.decode([520, 30, 198]) and rows[1]["input_ids"][-1] == EOS
    assert json.loads(rows[0]["generation"])["keep_unfinished"] is True

    drop = GenParams(temperature=1.0, top_p=0.9, max_new_tokens=3, seed=3)
    assert "keep_unfinished" not in drop.to_dict()
    table, bad = build_shard([{"prompt": "a"}, {"prompt": "b"}], 0, tok, max_len=64, params=drop,
                             generator=ScriptedGenerator([[cut, done]]), batch_size=2)
    assert table.column("row_id").to_pylist() == ["1-1"] and dict(bad) == {"generation_unfinished": 1}
    # a cut reply dropped for another reason is that drop only, not also a kept one
    table, bad = build_shard([{"prompt": "a"}], 0, tok, max_len=len(p_ids) + 2, params=keep,
                             generator=ScriptedGenerator([[cut]]), batch_size=2)
    assert len(table) == 0 and dict(bad) == {"too_long": 1}

    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    stats = run_data_stage([str(src)], tok, tmp_path / "out", max_len=64, params=keep, batch_size=2,
                           generator=ScriptedGenerator([[cut, done]]), target="scripted")
    assert stats["rows"] == 2 and stats["unfinished_kept"] == 1 and stats["dropped_total"] == 0
    assert stats["trained_tokens"] == 3 + 2


def test_cli_refuses_keep_unfinished_without_regeneration(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "response": "b"}])
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prepare_data.py"), "--input", str(src), "--out",
                        str(tmp_path / "out"), "--keep-unfinished"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip() == ("error: --keep-unfinished needs --regenerate (it keeps the "
                                                      "target's own cut replies)")
    assert not (tmp_path / "out").exists()

# ---- regeneration ----------------------------------------------------------------------------------------------


def test_regenerated_rows_keep_the_targets_exact_tokens(tok, tiny):
    model, _ = tiny
    records = [{"messages": CONVERSATION}, {"prompt": "Say hi."}, {"prompt": "Name a color.", "response": "Blue."}]
    table, bad = build_shard(records, 0, tok, max_len=256, params=PARAMS, generator=LocalGenerator(model, tok),
                             batch_size=2)
    rows = table.to_pylist()
    assert len(rows) + sum(bad.values()) == 4 and set(bad) <= {"empty_generation", "generation_unfinished"}
    assert len(rows) >= 2, f"the biased tiny target should finish most replies; dropped {dict(bad)}"
    for r in rows:
        prompt = json.loads(r["prompt"])
        p_ids = render_prompt(tok, prompt)
        ids, mask = r["input_ids"], np.asarray(r["loss_mask"])
        assert ids[:len(p_ids)] == p_ids and not mask[:len(p_ids)].any() and mask[len(p_ids):].all()
        assert ids[-1] == EOS and EOS not in ids[len(p_ids):-1]
        assert tok.decode(ids[len(p_ids):-1]) == r["response"] and r["response"].strip()
        assert r["regenerated"] and json.loads(r["generation"]) == PARAMS.to_dict()
    assert all(json.loads(r["prompt"])[-1]["role"] == "user" for r in rows)


def test_generation_is_seeded_and_batch_one_is_independent_of_the_batch(tok, tiny):
    model, _ = tiny
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in ("a", "what is this")]
    a = generate_batch(model, tok, prompts, PARAMS, seed=11)
    assert a == generate_batch(model, tok, prompts, PARAMS, seed=11)
    assert a != generate_batch(model, tok, prompts, PARAMS, seed=12)
    # Greedy: left padding changes nothing. (Without the stop bias, else greedy always stops at once.)
    greedy = GenParams(temperature=0.0, max_new_tokens=4)
    bias, model.generation_config.sequence_bias = model.generation_config.sequence_bias, None
    try:
        one = [generate_batch(model, tok, [p], greedy, seed=0)[0] for p in prompts]
        assert generate_batch(model, tok, prompts, greedy, seed=99) == one
    finally:
        model.generation_config.sequence_bias = bias
    assert [len(g.token_ids) for g in one] == [4, 4] and len(set(one[0].token_ids + one[1].token_ids)) > 2


def test_target_worker_generate_matches_in_process(tok, tiny, tiny_dir):
    from workers.frozen_target.worker import TargetWorker

    model, _ = tiny
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in ("x", "y z")]
    worker = TargetWorker(tiny_dir, [-1])
    assert worker.generate(prompts, PARAMS, 5) == generate_batch(model, tok, prompts, PARAMS, 5)


# ---- resume, Parquet, loader -----------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way catches it."""


def test_regeneration_resumes_after_a_kill_with_identical_output(tok, tiny, tmp_path):
    model, _ = tiny
    records = [{"prompt": f"Question {i}: what is {i} + {i}?"} for i in range(6)]
    records[2] = {"messages": CONVERSATION}
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    local = LocalGenerator(model, tok)
    kw = dict(max_len=256, params=PARAMS, batch_size=2, shard_size=2, target="tiny")
    ref = run_data_stage([str(src)], tok, tmp_path / "ref", generator=local, **kw)

    calls = []

    def dies_in_second_shard(batches, params):
        calls.append(len(batches))
        if len(calls) == 2:
            raise Killed()
        return local(batches, params)

    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        run_data_stage([str(src)], tok, out, generator=dies_in_second_shard, **kw)
    state = json.loads((out / "progress.json").read_text())
    assert list(state["completed"]) == ["00000"] and not state["complete"]
    with pytest.raises(ValueError, match="did not finish"):
        load_parquet_corpus(out)
    # Leftovers of a kill between the rename and the progress update, and of a half-written file.
    (out / "part-00001.parquet").write_bytes(b"stale")
    (out / "part-00002.parquet.tmp").write_bytes(b"half")
    with pytest.raises(ValueError, match="different settings.*max_len"):
        run_data_stage([str(src)], tok, out, generator=local, **{**kw, "max_len": 128})

    calls.clear()
    resumed = run_data_stage([str(src)], tok, out, generator=lambda b, p: calls.append(len(b)) or local(b, p), **kw)
    assert len(calls) == 2, "only the two unfinished shards are generated again"
    assert resumed == ref
    got, want = _rows(out), _rows(tmp_path / "ref")
    assert got == want and len(got) == ref["rows"] > 0
    ids = [r["row_id"] for r in got]
    assert len(set(ids)) == len(ids)
    assert [(r["source_index"], r["turn_index"]) for r in got] == sorted((r["source_index"], r["turn_index"])
                                                                       for r in got)
    assert ref["rows"] + ref["dropped_total"] == 7  # 5 prompts + 2 turns of the conversation, none lost
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet", "part-00001.parquet",
                                                    "part-00002.parquet", "progress.json", "stats.json"]


def test_parquet_is_zstd_and_loads_as_training_samples(tok, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", BAD_RECORDS)
    run_data_stage([str(src)], tok, tmp_path / "out", max_len=64, shard_size=4)
    for f in sorted((tmp_path / "out").glob("part-*.parquet")):
        meta = pq.ParquetFile(f).metadata
        cols = [meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns)]
        assert cols and {c.compression for c in cols} == {"ZSTD"}
    rows = _rows(tmp_path / "out")
    samples = load_parquet_corpus(tmp_path / "out")
    assert [s.sample_id for s in samples] == [0, 1, 2]
    for s, r in zip(samples, rows):
        assert s.input_ids.tolist() == r["input_ids"] and s.loss_mask.tolist() == r["loss_mask"]
        assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == bool
    assert [len(s.input_ids) for s in load_parquet_corpus(tmp_path / "out", max_len=50)] == [46, 38]  # 64 dropped
    assert len(load_parquet_corpus(tmp_path / "out" / "part-00000.parquet", num_samples=1)) == 1


def test_training_config_reads_a_parquet_source(tok, tmp_path):
    from pipeline.config import RunConfig
    from workers.inputs import load_samples

    src = _write_jsonl(tmp_path / "in.jsonl", BAD_RECORDS)
    run_data_stage([str(src)], tok, tmp_path / "out", max_len=64)
    cfg = RunConfig()
    cfg.data.source, cfg.data.max_len, cfg.data.num_samples = str(tmp_path / "out"), 64, 2
    samples = load_samples(cfg, tm.smollm2_path())
    assert [s.input_ids.tolist() for s in samples] == [r["input_ids"] for r in _rows(tmp_path / "out")[:2]]


# ---- slow: a real SIGKILL, a real Ray actor --------------------------------------------------------------------


def _cli(src: Path, out: Path, target: Path) -> list[str]:
    return [sys.executable, str(REPO / "launch" / "prepare_data.py"), "--input", str(src), "--out", str(out),
            "--target", str(target), "--regenerate", "--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens",
            "10", "--batch-size", "2", "--shard-size", "2", "--max-len", "256", "--seed", "3"]


@pytest.mark.slow
def test_cli_resumes_after_sigkill(tiny_dir, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Question {i}?"} for i in range(16)])
    subprocess.run(_cli(src, tmp_path / "ref", tiny_dir), check=True, capture_output=True)
    proc = subprocess.Popen(_cli(src, tmp_path / "out", tiny_dir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    progress = tmp_path / "out" / "progress.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and len(json.loads(progress.read_text())["completed"]) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; give it more records"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not json.loads(progress.read_text())["complete"]
    done = subprocess.run(_cli(src, tmp_path / "out", tiny_dir), check=True, capture_output=True, text=True)
    assert "16 records" in done.stdout
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")


@pytest.mark.slow
def test_ray_target_worker_generates_like_in_process(tok, tiny, tiny_dir, tmp_path, local_ray):
    from workers.frozen_target.generation import RayGenerator
    from workers.frozen_target.worker import start_target_actor

    model, _ = tiny
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Question {i}?"} for i in range(5)])
    kw = dict(max_len=256, params=PARAMS, batch_size=2, shard_size=5)
    ref = run_data_stage([str(src)], tok, tmp_path / "ref", generator=LocalGenerator(model, tok), **kw)
    actors = [start_target_actor(tiny_dir, [-1]) for _ in range(2)]
    got = run_data_stage([str(src)], tok, tmp_path / "ray", generator=RayGenerator(actors), **kw)
    assert got == ref and _rows(tmp_path / "ray") == _rows(tmp_path / "ref")
