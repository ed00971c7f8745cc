"""The metric sinks after a crash (pipeline/metrics.py): a resume from the checkpoint of step S drops the JSONL rows
and hides the TensorBoard events of steps past S, so the record holds one curve. In-process, a few seconds.

Run: python -m pytest tests/test_metrics.py -q
"""

from __future__ import annotations

import json

from pipeline.metrics import JsonlSink, TensorBoardSink, drop_rows_after, read_jsonl_metrics


def _rows(path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def test_resume_drops_the_rows_past_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, resume_step=0)
    for step in range(1, 7):
        sink.log(step, {"loss": float(step)})
    sink.close()
    # crash after step 6, resume from the checkpoint of step 4: steps 5 and 6 are trained again
    sink = JsonlSink(path, resume_step=4)
    assert _rows(path) == [(s, float(s)) for s in range(1, 5)]
    for step in (5, 6, 7):
        sink.log(step, {"loss": 10.0 + step})
    sink.close()
    assert _rows(path) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0), (6, 16.0), (7, 17.0)]
    assert not (tmp_path / "metrics.jsonl.partial").exists()


def test_fresh_start_drops_every_row_of_a_run_without_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    JsonlSink(path, resume_step=0).close()
    assert path.read_text() == ""


def test_a_file_with_nothing_past_the_checkpoint_is_left_as_it_is(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    before = path.stat()
    assert drop_rows_after(path, 2) == 0 and drop_rows_after(path, 5) == 0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert drop_rows_after(tmp_path / "missing.jsonl", 3) == 0


def test_torn_line_and_repeated_steps_go(tmp_path):
    """A crash mid-write leaves a line without its end (the next append would be glued onto it); a file written
    before the resume rule repeats steps (the last row of a step is the re-trained one)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 3.0}\n'
                    '{"step": 2, "loss": 2.5}\n{"step": 3, "loss": 3.5}\n{"step": 4, "lo')
    assert drop_rows_after(path, 3) == 3
    assert _rows(path) == [(1, 1.0), (2, 2.5), (3, 3.5)]
    assert path.read_text().endswith("\n")
    assert {s: r["loss"] for s, r in read_jsonl_metrics(path).items()} == {1: 1.0, 2: 2.5, 3: 3.5}


def test_tensorboard_resume_purges_the_steps_past_its_checkpoint(tmp_path):
    """What TensorBoard shows after a resume (its Python event loader, which honours the purge event; its Rust data
    server drops a tag's events at or past a step logged again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tensorboard"
    sink = TensorBoardSink(log_dir, resume_step=0)
    for step in range(1, 7):
        sink.log(step, {"loss": float(step), "lr": 0.1})
    sink.close()
    sink = TensorBoardSink(log_dir, resume_step=4)  # crash after step 6, resume from step 4, retrain 5
    sink.log(5, {"loss": 15.0, "lr": 0.1})
    sink.close()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0)]
    assert [e.step for e in acc.Scalars("lr")] == [1, 2, 3, 4, 5]  # step 6 is gone though nothing logged it again
