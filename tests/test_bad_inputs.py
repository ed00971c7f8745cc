"""Every bad config value and every bad data file is one line naming the key or the file, exit status 2, before
Ray starts (issue #21, items 2 and 3). Each case runs the launch script's `main` in this process, as
`launch/train_v4_draft.py --run-dir R ARGS` would, with Ray's connect replaced by a failure: a case that got past
the config and the input resolution would fail the test instead of starting a cluster. The script's own process
and output are checked once each in tests/test_launch_errors.py.

Run: python -m pytest tests/test_bad_inputs.py -q     (about 30 s on 2 cores, most of it importing Ray Train once)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from launch_helpers import LAUNCH, TINY_MOE


@pytest.fixture(scope="module")
def launch():
    spec = importlib.util.spec_from_file_location("train_v4_draft", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run(launch, monkeypatch, capsys, tmp_path):
    """run(args) -> the one `error:` line of `main(["--run-dir", R, *args])`, after asserting exit status 2, no
    other line but log lines, and no run dir made."""
    import workers.driver

    def no_ray(cfg):
        raise AssertionError("Ray would start: the bad input got past the launcher's checks")

    monkeypatch.setattr(workers.driver, "connect_ray", no_ray)
    for handler in logging.getLogger("dspark.launch").handlers:  # made before capsys: write where it captures
        if type(handler) is logging.StreamHandler:  # ours; pytest >= 9.2 hangs its own capture handlers here too
            monkeypatch.setattr(handler, "stream", sys.stderr)
    run_dir = tmp_path / "run"

    def call(args: list[str]) -> str:
        code = launch.main(["--run-dir", str(run_dir), *args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if not re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) ", ln)]
        assert code == 2, err[-3000:]
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
        assert not (run_dir / "checkpoints").exists()
        return lines[0]

    return call


CONFIG_CASES = [  # (override, what the line must say)
    ("draft.num_kv_heads=0", "draft.num_kv_heads must be >= 1, got 0"),
    ("draft.num_heads=0", "draft.num_heads must be >= 1, got 0"),
    ("draft.num_layers=0", "draft.num_layers must be >= 1, got 0"),
    ("train.betas=[2,3]", "train.betas must be 2 values, each in [0, 1), got [2.0, 3.0]"),
    ("train.betas=[0.9]", "train.betas must be 2 values"),
    ("data.seed=-1", "data.seed must be in [0, 4294967295], got -1"),
    ("train.seed=-1", "train.seed must be in [0, 4294967295]"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0 (0 = off), got -1.0"),
    ("target.max_tokens_per_forward=0", "target.max_tokens_per_forward must be >= 1, got 0"),
    ("cluster.cpus_per_trainer=-1", "cluster.cpus_per_trainer must be >= 0, got -1.0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1, got 0"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps must be >= 1"),
    ("train.lr=.nan", "train.lr must be > 0, got nan"),
    ("train.lr=inf", "train.lr must be > 0, got inf"),
    ("train.log_every=0", "train.log_every must be >= 1"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1], got 2.0"),
    ("target.max_restarts=-2", "target.max_restarts must be >= 0, or -1 (no limit), got -2"),
    ("target.dtype=fp8", "target.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'fp8'"),
    ("target.resources_per_worker={accel: -1}", "target.resources_per_worker must be a mapping whose values"),
    ("draft.arch=nope", "draft.arch must be one of ['draft-lm', 'dspark', 'dsv4', 'eagle3'], got 'nope'"),
    ("draft.target_layers=[]", "draft.target_layers must be a non-empty list, each >= 0, or -1"),
    ("draft.target_layers=[-3]", "draft.target_layers must be a non-empty list"),
    ("draft.moe.num_experts=0", "draft.moe.num_experts must be >= 1, got 0"),
    ("draft.moe.top_k=9", "draft.moe.top_k (9) must be <= draft.moe.num_experts (4)"),
    ("draft.num_heads=8", "draft.num_heads (8) must be a multiple of num_kv_heads (3)"),
    ("draft.rms_norm_eps=0", "draft.rms_norm_eps must be > 0"),
    ("loss.decay_lambda=0", "loss.decay_lambda must be > 0"),
    ("loss.matmul_dtype=fp16", "loss.matmul_dtype must be one of ['auto', 'float32', 'bfloat16']"),
    ("data.max_len=5", "data.max_len (5) must exceed draft.block_size (5)"),
    ("data.source=", "data.source must be a non-empty string"),
    ("cluster.dashboard_host=", "cluster.dashboard_host must be a non-empty string"),
    ("train.betas=[2,3", "override 'train.betas=[2,3' is not valid YAML: while parsing a flow sequence expected ','"),
    ("train.lr={a: *b}", "override 'train.lr={a: *b}' is not valid YAML: found undefined alias 'b' at line 1"),
]


@pytest.mark.parametrize("override, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_a_bad_config_value_is_one_line_naming_the_key_and_range(run, override, needle):
    line = run([override])
    assert needle in line, line


def _jsonl(path, *lines: str | bytes):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


GOOD = json.dumps({"text": "def add(a, b):\n    return a + b\n" * 4})

DATA_CASES = {  # name: (make the file in tmp_path, what the line must say besides the file's path)
    "invalid JSON line": (lambda d: _jsonl(d / "broken.jsonl", GOOD, '{"text": "unfinished'),
                          "line 2 is not valid JSON"),
    "plain text as JSONL": (lambda d: _jsonl(d / "notes.jsonl", "just some notes", "more notes"),
                            "line 1 is not valid JSON"),
    "not UTF-8": (lambda d: _jsonl(d / "latin1.jsonl", GOOD, '{"text": "caf\u00e9"}'.encode("latin-1")),
                  "line 2 is not UTF-8 text (byte 0xe9"),
    "a number for a record": (lambda d: _jsonl(d / "numbers.jsonl", GOOD, "42"), "line 2 is a JSON int, not an object"),
    "a JSON array of numbers": (lambda d: _jsonl(d / "array.json", "[1, 2]"), "record 1 is a JSON int, not an object"),
    "neither text nor messages": (lambda d: _jsonl(d / "prompts.jsonl", GOOD, json.dumps({"prompt": "x"})),
                                  "prompts.jsonl:2: a record needs a 'text' or a 'messages' field"),
    "empty assistant turn": (lambda d: _jsonl(d / "chat.jsonl", json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})),
        "chat.jsonl:1: assistant turn 1 is empty"),
    "Parquet with other columns": (lambda d: _parquet(d / "other.parquet", tokens=[[1, 2, 3]], text=["abc"]),
                                   "no column input_ids; no column loss_mask; training reads input_ids"),
    "Parquet input_ids not a list": (lambda d: _parquet(d / "flat.parquet", input_ids=[1, 2, 3],
                                                        loss_mask=[[True], [True], [True]]),
                                     "input_ids is int64, not a list of integers"),
    "not Parquet": (lambda d: _jsonl(d / "fake.parquet", GOOD), "is not a readable Parquet file"),
    "mask and ids of other lengths": (lambda d: _parquet(d / "ragged.parquet", input_ids=[[1, 2, 3], [4, 5, 6]],
                                                         loss_mask=[[False, True, True], [True, True]]),
                                      "row 1: input_ids has 3 tokens but loss_mask 2"),
}


def _zst(path, *lines: str, cut: int | None = None):
    import zstandard

    data = zstandard.ZstdCompressor().compress("".join(line + "\n" for line in lines).encode())
    path.write_bytes(data[:cut])
    return path


def _gz(path, *lines: str):
    import gzip

    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    return path


DATA_CASES.update({
    "truncated .jsonl.zst": (lambda d: _zst(d / "cut.jsonl.zst", *[GOOD] * 50, cut=40),
                             "is not a readable zstd file (EOFError: the file ends inside a zstd frame)"),
    "a .jsonl.gz that is not gzip": (lambda d: _jsonl(d / "plain.jsonl.gz", GOOD),
                                     "is not a readable gzip file (BadGzipFile: Not a gzipped file"),
    "a bad line inside a .jsonl.zst": (lambda d: _zst(d / "broken.jsonl.zst", GOOD, '{"text": "unfinished'),
                                       "line 2 is not valid JSON"),
    "a bad line inside a .jsonl.gz": (lambda d: _gz(d / "numbers.jsonl.gz", GOOD, "42"),
                                      "line 2 is a JSON int, not an object"),
})


def _bad_progress(d):
    (d / "stage").mkdir()
    (d / "stage" / "progress.json").write_text("{not json")
    return d / "stage"


DATA_CASES["data-stage progress.json broken"] = (_bad_progress, "progress.json is not valid JSON")


@pytest.mark.parametrize("name", list(DATA_CASES))
def test_a_bad_data_file_is_one_line_naming_the_file(run, tmp_path, name):
    make, needle = DATA_CASES[name]
    path = make(tmp_path)
    line = run([*TINY_MOE, f"data.source={path}"])
    assert str(path) in line and needle in line, line


YAML_CASES = {  # name: (the config file's bytes, what the line must say after "config file PATH ")
    "unclosed list": (b"train:\n  lr: [1,\n", "is not valid YAML: while parsing a flow node expected the node "
                      "content, but found '<stream end>' at line 3, column 1"),
    "a tab for indentation": (b"train:\n\tlr: 1\n", "is not valid YAML: while scanning for the next token found "
                              "character '\\t' that cannot start any token at line 2, column 1"),
    "a section given twice": (b"train:\n  lr: 1\ntrain:\n  max_steps: 2\n",
                              "is not valid YAML: key 'train' is given twice at line 3, column 1"),
    "two documents": (b"train:\n  lr: 1\n---\ndata: {}\n", "is not valid YAML: expected a single document in the "
                      "stream but found another document at line 3, column 1"),
    "an undefined alias": (b"train: *defaults\n", "is not valid YAML: found undefined alias 'defaults'"),
    "a Python tag": (b"train: !!python/object:os.system x\n", "is not valid YAML: could not determine a constructor"),
    "not UTF-8": (b"train:\n  lr: 1 # caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 20)"),
    "a list at the top": (b"- train\n", "must hold a mapping at the top level, not a list"),
}


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_a_bad_config_file_is_one_line_naming_the_file(run, tmp_path, name):
    text, needle = YAML_CASES[name]
    path = tmp_path / "run.yaml"
    path.write_bytes(text)
    line = run(["--config", str(path)])
    assert line.startswith(f"error: config file {path} ") and needle in line, line


def test_a_config_path_that_is_a_directory(run, tmp_path):
    assert run(["--config", str(tmp_path)]) == f"error: config file {tmp_path} is a directory, not a YAML file"


def test_flags_and_overrides_come_in_any_order(launch):
    args = launch.parse_args(["train.lr=3e-4", "--single-process", "data.max_len=256", "--max-steps", "3",
                              "train.seed=7"])
    assert args.single_process and args.max_steps == 3
    assert args.overrides == ["train.lr=3e-4", "data.max_len=256", "train.seed=7"]
    cfg = launch.build_config(args)
    assert (cfg.train.lr, cfg.data.max_len, cfg.train.max_steps, cfg.train.seed) == (3e-4, 256, 3, 7)


# --- the target directory: every file of it ---------------------------------------------------------------------


def _target_copy(d):
    import shutil

    from workers.frozen_target.model import resolve_target_path

    out = d / "target"
    shutil.copytree(resolve_target_path("tiny-qwen3-moe"), out)
    return out


def _edit_config(**changes):
    def damage(t):
        cfg = json.loads((t / "config.json").read_text())
        cfg.update(changes)
        (t / "config.json").write_text(json.dumps(cfg))
    return damage


def _cut(name, keep):
    def damage(t):
        (t / name).write_bytes((t / name).read_bytes()[:keep])
    return damage


def _write(name, data: bytes):
    def damage(t):
        (t / name).write_bytes(data)
    return damage


TARGET_CASES = {  # name: (damage the copied target dir, (file, what the line must say after "target FILE"))
    "config.json cut short": (_cut("config.json", 40), ("config.json", " is not valid JSON (")),
    "config.json empty": (_write("config.json", b""), ("config.json", " is empty")),
    "config.json without model_type": (_edit_config(model_type=None), ("config.json", " names no model_type")),
    "config.json of an unknown model_type": (_edit_config(model_type="nope"),
                                             ("config.json", " is not a config transformers can build (")),
    "other attention heads in config.json than in the weights": (_edit_config(num_attention_heads=8), (
        "model.safetensors", ": model.layers.0.self_attn.o_proj.weight is [64, 64], but config.json makes it "
        "[64, 128]")),
    "more layers in config.json than weights": (_edit_config(num_hidden_layers=5), (
        "", ": config.json says num_hidden_layers 5, but the weights hold no layer 3 (nor 1 more)")),
    "another vocab_size in config.json": (_edit_config(vocab_size=1000), (
        "model.safetensors", ": lm_head.weight is [49152, 64], but config.json makes it [1000, 64]")),
    "weights cut short": (_cut("model.safetensors", 5000), (
        "model.safetensors", " is not a readable safetensors file (SafetensorError: Error while deserializing header")),
    "weights not safetensors": (_write("model.safetensors", b"x" * 5000), (
        "model.safetensors", " is not a readable safetensors file (SafetensorError: ")),
    "no weights": (lambda t: (t / "model.safetensors").unlink(), ("", " holds no weights (*.safetensors)")),
    "an index naming a missing shard": (_write("model.safetensors.index.json", json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}).encode()),
        ("model.safetensors.index.json", " names 1 file(s) ")),
    "tokenizer.json cut short": (_cut("tokenizer.json", 100), ("tokenizer.json", " is not valid JSON (")),
    "generation_config.json not UTF-8": (_write("generation_config.json", b'{"x": "\xff"}'),
                                         ("generation_config.json", " is not UTF-8 text (byte 0xff at offset 7)")),
    "no tokenizer": (lambda t: (t / "tokenizer.json").unlink(), (
        "", " has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json)")),
}


@pytest.mark.parametrize("name", list(TARGET_CASES))
def test_a_bad_target_file_is_one_line_naming_it(run, tmp_path, name):
    damage, (file, needle) = TARGET_CASES[name]
    target = _target_copy(tmp_path)
    damage(target)
    line = run([*TINY_MOE, f"target.path={target}"])
    where = target / file if file else target
    assert line.startswith(f"error: target {where}{needle}"), line


def test_a_chat_template_that_does_not_compile_names_its_file_and_line(run, tmp_path):
    target = _target_copy(tmp_path)
    (target / "chat_template.jinja").write_text("{{ bos_token }}\n{% for m in %}")
    line = run([*TINY_MOE, f"target.path={target}"])
    assert line == (f"error: target {target / 'chat_template.jinja'} line 2: the chat template does not compile "
                    "(Expected an expression, got 'end of statement block')"), line


def test_a_damaged_gguf_target_is_one_line(run, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    line = run([*TINY_MOE, f"target.path={path}"])
    assert line.startswith(f"error: target {path} is not a readable GGUF file ("), line
