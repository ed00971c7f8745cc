"""The sample ledger: write/read round trip, an audit that catches a duplicated, a lost and a wrong batch, and the
audit CLI's one line on a run dir it cannot read.

Run: python -m pytest tests/test_ledger.py -q
"""

from __future__ import annotations

from pathlib import Path

from pipeline.order import batch_index_for, batch_sample_ids
from workers.trainer.ledger import Ledger, audit, read_ledger, write_ledger

N, SPB, SEED, GA, WORLD = 10, 3, 5, 2, 2


def _rows(steps: int) -> list:
    """What `fit` records: every rank's micro-batches of steps 1..steps."""
    rows = []
    for s in range(steps):
        for r in range(WORLD):
            for m in range(GA):
                b = batch_index_for(s, m, r, GA, WORLD)
                rows.append((s + 1, b, r, WORLD, tuple(batch_sample_ids(b, N, SPB, SEED))))
    return rows


def test_roundtrip_and_commit_order(tmp_path):
    ledger = Ledger(samples_digest="abc")
    rows = _rows(3)
    gathered = [[r for r in rows if r[2] == rank] for rank in range(WORLD)]
    committed = ledger.commit(gathered)
    assert committed == sorted(rows, key=lambda r: (r[0], r[1])) and ledger.pending == []
    write_ledger(committed, tmp_path / "l.parquet", "abc")
    back, digest = read_ledger(tmp_path / "l.parquet")
    assert back == committed and digest == "abc"


def test_audit_clean_across_epochs():
    # 3 steps x 4 batches x 3 samples = 36 = 3 epochs of 10 (each epoch is 4 batches: 3 + 3 + 3 + 1)
    result = audit(_rows(3), N, SPB, SEED, GA * WORLD)
    assert result.exactly_once and result.steps == 3 and result.batches == 12
    assert result.samples_trained == 3 * (3 + 3 + 3 + 1)


def test_audit_catches_duplicates_losses_and_wrong_batches():
    rows = _rows(3)
    dup = audit(rows + [rows[5]], N, SPB, SEED, GA * WORLD)
    assert dup.duplicates == len(rows[5][4]) and dup.lost == 0
    lost = audit(rows[:4] + rows[5:], N, SPB, SEED, GA * WORLD)
    assert lost.lost == len(rows[4][4]) and lost.duplicates == 0
    s, b, r, w, ids = rows[2]
    wrong = audit(rows[:2] + [(s, b, r, w, ids[::-1])] + rows[3:], N, SPB, SEED, GA * WORLD)
    assert wrong.wrong == 1 and wrong.duplicates == 0 and wrong.lost == 0


def test_samples_digest_sees_tokens_and_masks_not_the_container():
    import numpy as np

    from pipeline.contracts import TokenizedSample
    from pipeline.sample_store import samples_digest

    a = [TokenizedSample(0, np.array([1, 2, 3], dtype=np.int32), np.array([0, 1, 1], dtype=bool))]
    same = [TokenizedSample(0, np.array([1, 2, 3], dtype=np.int64), np.array([0, 1, 1], dtype=bool))]
    other_mask = [TokenizedSample(0, np.array([1, 2, 3]), np.array([1, 1, 1], dtype=bool))]
    split = [TokenizedSample(0, np.array([1]), np.array([0], dtype=bool)),
             TokenizedSample(1, np.array([2, 3]), np.array([1, 1], dtype=bool))]
    assert samples_digest(a) == samples_digest(same)
    assert len({samples_digest(x) for x in (a, other_mask, split)}) == 3


def _cli(capsys, path) -> tuple[int, list[str]]:
    from workers.trainer.ledger import main

    code = main([str(path)])
    return code, capsys.readouterr().err.strip().splitlines()


def test_the_audit_cli_prints_one_line_on_a_run_dir_it_cannot_read(tmp_path, capsys, monkeypatch):
    """python -m workers.trainer.ledger RUN_DIR: exit 2 and one line, never a traceback."""
    missing = tmp_path / "nothing"
    assert _cli(capsys, missing) == (2, [f"error: no checkpoint with a ledger.parquet at {missing}"])

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("garbage\n")
    code, lines = _cli(capsys, tmp_path)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: cannot audit {tmp_path}: CheckpointError: ")

    ckpt = tmp_path / "ckpt"  # a checkpoint dir given directly, its ledger unreadable
    ckpt.mkdir()
    (ckpt / "meta.json").write_text('{"step": 1, "config": {"data": {"samples_per_batch": 3, "seed": 5}}, '
                                    '"data_position": {"num_samples": 10, "grad_accum": 2, "world_size": 2}}')
    (ckpt / "ledger.parquet").write_bytes(b"PAR1 not parquet")
    code, lines = _cli(capsys, ckpt)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: cannot audit {ckpt}: ArrowInvalid: "), lines

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "is_file", denied)  # a run dir this user may not read
    assert _cli(capsys, tmp_path) == (2, [f"error: cannot audit {tmp_path}: PermissionError: [Errno 13] Permission "
                                          "denied"])
