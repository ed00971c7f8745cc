"""Elastic resume on real DeepSpeed ranks (gloo, CPU, fp32): a run checkpointed on 2 ranks x grad_accum 1 resumes on
1 rank x grad_accum 2, that one resumes on 2 ranks again, and the losses of every step equal an uninterrupted 2-rank
run; workers/trainer/reshard.py converts through DeepSpeed's universal checkpoint (ZeRO-1/2/3) or loads as is (ZeRO-0).

Run: python -m pytest tests/test_elastic_resume.py -q     (ZeRO-2 with the MoE bias and the elastic group's grad_accum,
     about 30 s on 2 cores; the other stages, 3 ranks, bf16 and the launches: -m slow, ~15 min)
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from draft_fixtures import frozen_weights
from test_distributed_step import _ListSink, _micro, _run_cfg

from pipeline.order import batch_index_for
from workers.trainer.reshard import ELASTIC_STAGES, adapt_to_checkpoint, check_stage, elastic_grad_accum

STEPS, EVERY = 6, 2


def _cfg(stage: int, ga: int, world: int, run_dir: str, bias_rate: float, precision: str = "fp32") -> object:
    cfg = _run_cfg()
    cfg.train.precision = precision
    if precision == "fp32":  # all of it: bf16 loss matmuls (the default) round the logits, which turns the world
        # size's 1e-7 all-reduce-order differences into 1e-5 loss differences; these tests compare runs to 1e-6
        cfg.loss = replace(cfg.loss, matmul_dtype="float32")
    cfg.draft = replace(cfg.draft, moe=replace(cfg.draft.moe, bias_update_rate=bias_rate))
    t = cfg.train
    t.max_steps, t.warmup_steps, t.grad_accum, t.zero_stage = STEPS, 2, ga, stage
    cfg.cluster.num_trainers = world
    cfg.checkpoint.run_dir, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = run_dir, EVERY, 3
    return cfg


class _GlobalBatches:
    """Feature batch b is a fixed function of b: every step a new global batch, whichever rank consumes it."""

    def __init__(self, rank: int, world: int, cfg) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg

    def start(self, step: int) -> None:
        pass

    def take(self, step: int) -> list:
        ga, bf16 = self.cfg.train.grad_accum, self.cfg.train.precision == "bf16"
        out = [_micro(batch_index_for(step, m, self.rank, ga, self.world), self.cfg.draft.block_size)
               for m in range(ga)]
        if bf16:  # features arrive in the engine's dtype, as pack_micro_batch decodes them
            out = [m._replace(batch=replace(m.batch, ctx_feats_TF=m.batch.ctx_feats_TF.bfloat16(),
                                            final_hidden_TD=m.batch.final_hidden_TD.bfloat16())) for m in out]
        return out

    def close(self) -> None:
        pass


def _phase(rank: int, world: int, runs: list[tuple[int, int, str, str | None, float, str]]) -> list[dict]:
    """Each run (stage, grad_accum, run_dir, resume_from, bias rate, precision) through the trainer's own resume path
    (workers/trainer/engines.resumed_engine: universal_source -> deepspeed_engine -> resume | load_universal).
    Rank 0 returns the logged losses by step, the LR of the first resumed step and the MoE balance bias right after the
    load."""
    from draft_model.moe import MoE
    from draft_model.registry import build_draft
    from workers.trainer.checkpoint import CheckpointManager
    from workers.trainer.engines import resumed_engine
    from workers.trainer.loop import fit
    from workers.trainer.step import DraftWithLoss, setup_moe_balance

    log = logging.getLogger("test")
    embed, head = frozen_weights()
    out = []
    for stage, ga, run_dir, resume_from, bias_rate, precision in runs:
        cfg = _cfg(stage, ga, world, run_dir, bias_rate, precision)
        torch.manual_seed(cfg.train.seed)
        draft = build_draft(cfg.draft, embed, head)
        setup_moe_balance(draft)
        ckpts = CheckpointManager(run_dir, keep_last=3)
        engine, start, _, universal = resumed_engine(DraftWithLoss(draft, cfg.loss), cfg, ckpts,
                                                     Path(resume_from) if resume_from else None, rank, world, log)
        moes = [m for m in engine.module.modules() if isinstance(m, MoE)]
        bias = [m.router_bias_E.clone() for m in moes]
        sink = _ListSink()
        fit(engine, _GlobalBatches(rank, world, cfg), ckpts, sink, cfg, rank, world, start, log)
        out.append({"losses": dict(zip(range(start + 1, STEPS + 1), sink.losses)), "bias": bias,
                    "bias_end": [m.router_bias_E.clone() for m in moes],
                    "universal": str(universal) if universal else None, "global_steps": engine.global_steps})
        engine.destroy()
    return out


def _elastic(tmp_path: Path, stages: list[int], bias_rate: float,
             plan: tuple[tuple[int, int], ...] = ((2, 1), (1, 2), (2, 1)),
             precision: str = "fp32") -> dict[int, tuple[dict, dict, dict]]:
    """Per stage, `plan` = (ranks, grad_accum) of three runs: the first uninterrupted for 6 steps (checkpoints 2, 4,
    6), the second from its step 2, the third from the second's step 4. Returns their results per stage."""
    d = {s: {k: str(tmp_path / f"z{s}-{k}") for k in ("a", "b", "c")} for s in stages}
    ck = {s: {k: Path(v) / "checkpoints" for k, v in d[s].items()} for s in stages}
    (ra, ga_a), (rb, ga_b), (rc, ga_c) = plan
    straight = run_ranks(_phase, ra, [(s, ga_a, d[s]["a"], None, bias_rate, precision) for s in stages])[0]
    shrunk = run_ranks(_phase, rb, [(s, ga_b, d[s]["b"], str(ck[s]["a"] / "step_00000002"), bias_rate, precision)
                                    for s in stages])[0]
    regrown = run_ranks(_phase, rc, [(s, ga_c, d[s]["c"], str(ck[s]["b"] / "step_00000004"), bias_rate, precision)
                                     for s in stages])[0]
    return {s: (straight[i], shrunk[i], regrown[i]) for i, s in enumerate(stages)}


def _assert_same_run(stage: int, a: dict, b: dict, c: dict, rel: float) -> float:
    """b and c log every step they ran with a's loss to `rel`; returns the worst relative difference."""
    ref = a["losses"]
    assert sorted(ref) == list(range(1, STEPS + 1)), ref
    assert sorted(b["losses"]) == [3, 4, 5, 6] and sorted(c["losses"]) == [5, 6]
    worst = max(abs(r["losses"][s] / ref[s] - 1) for r in (b, c) for s in r["losses"])
    for r in (b, c):
        for s, loss in r["losses"].items():
            assert loss == pytest.approx(ref[s], rel=rel), (stage, s, loss, ref[s], worst)
    # DeepSpeed's own step counter (drives nothing here, but a mismatch would show a lost restore)
    assert a["global_steps"] == b["global_steps"] == c["global_steps"] == STEPS
    return worst


def _two_to_one_to_two(tmp_path: Path, stages: list[int]) -> dict[int, tuple[dict, dict, dict]]:
    """MoE balance bias on (the default rate): every resumed step's loss equals the uninterrupted
    run's to 1e-6 relative. fp32; what may differ is only where the sums happen (2 ranks all-reduce two micro-batch
    gradients, 1 rank accumulates them): measured 0 (the two orders round alike here; the scale factors are powers of
    two). For scale: zeroing Adam's moments in the universal copy moved step 4 by 4e-3, and the two ZeRO-3 load slips
    that workers/trainer/reshard repairs by 1e-5..1e-3, so 1e-6 catches any lost state and leaves room for real
    reordering."""
    results = _elastic(tmp_path, stages, bias_rate=1e-3)
    for stage, (a, b, c) in results.items():
        worst = _assert_same_run(stage, a, b, c, rel=1e-6)
        # ZeRO-0: a plain load; 1/2: a universal copy next to, not inside, the checkpoints
        assert (b["universal"] is None) == (stage == 0), (stage, b["universal"])
        if stage:
            uni = Path(b["universal"])
            assert uni == tmp_path / f"z{stage}-b" / "reshard" / "step_00000002"
            assert json.loads((uni / "source.json").read_text())["world_size"] == 2
        print(f"ZeRO-{stage}: worst relative loss difference after elastic resume {worst:.2e}")
    return results


def test_two_to_one_to_two_ranks_continue_the_same_run(tmp_path):
    """ZeRO-2, the default stage: the default suite's one elastic resume. With the MoE balance bias on (the
    default), DeepSpeed's universal load does not restore it (it loads no module state dict); workers/trainer/reshard
    restores it, so the first resumed step starts from the saved bias."""
    (a, b, c), = _two_to_one_to_two(tmp_path, [2]).values()
    saved = torch.load(sorted((tmp_path / "z2-a" / "checkpoints" / "step_00000002" / "ds")
                              .glob("*model_states.pt"))[0], weights_only=False)["module"]
    saved_bias = [v for k, v in saved.items() if k.endswith("router_bias_E")]
    assert saved_bias and float(saved_bias[0].abs().max()) > 0
    for got, want in zip(b["bias"], saved_bias, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The bias moves once per optimizer step from the load of the whole global batch (draft_model/moe.py,
    # deferred mode), so 1 rank x 2 micro-steps and 2 ranks x 1 move it alike: the same bias at the end, exactly.
    # (Updated after every forward instead, as before, the runs' biases drifted apart within 4 steps.)
    worst = max(abs(r["losses"][s] / a["losses"][s] - 1) for r in (b, c) for s in r["losses"])
    apart = max(float((x - y).abs().max()) for x, y in zip(a["bias_end"], c["bias_end"], strict=True))
    print(f"MoE bias on: worst relative loss difference {worst:.2e}, bias apart by {apart:.1e} after 6 steps")
    assert worst <= 1e-6 and apart == 0, (worst, apart)


@pytest.mark.slow
def test_two_to_one_to_two_ranks_at_the_other_zero_stages(tmp_path):
    """ZeRO-0, 1 and 3: the same run, the same rule."""
    _two_to_one_to_two(tmp_path, [s for s in ELASTIC_STAGES if s != 2])


@pytest.mark.slow
def test_two_to_one_to_three_ranks(tmp_path):
    """ZeRO-2 (the default): global batch 6 = 2 ranks x 3 = 1 x 6 = 3 x 2; a 3-rank run from a 1-rank checkpoint
    (ZeRO pads partitions that 3 does not divide). About 80 s."""
    (a, b, c), = _elastic(tmp_path, [2], bias_rate=0.0, plan=((2, 3), (1, 6), (3, 2))).values()
    worst = _assert_same_run(2, a, b, c, rel=1e-6)
    print(f"ZeRO-2, 2 -> 1 -> 3 ranks: worst relative loss difference {worst:.2e}")


@pytest.mark.slow
def test_bf16_two_to_one_to_two_ranks(tmp_path):
    """DeepSpeed's bf16 mode (bf16 weights and features, fp32 master weights and Adam state), ZeRO-1/2/3: the universal
    checkpoint carries the fp32 master copy, so the resumed run is the same run here too (measured bit-equal on
    CPU/gloo). bf16 is 30-70x slower on CPUs without AMX: about 3 minutes."""
    results = _elastic(tmp_path, [1, 2, 3], bias_rate=0.0, precision="bf16")
    for stage, (a, b, c) in results.items():
        worst = _assert_same_run(stage, a, b, c, rel=1e-6)
        print(f"bf16 ZeRO-{stage}: worst relative loss difference {worst:.2e}")


def _meta(world: int, ga: int, stage: int = 2) -> dict:
    return {"data_position": {"world_size": world, "grad_accum": ga, "next_batch_index": 0},
            "config": {"train": {"zero_stage": stage}}}


def test_driver_keeps_the_global_batch(monkeypatch):
    cfg = _run_cfg()
    cfg.cluster.num_trainers = 1
    assert elastic_grad_accum(cfg, _meta(2, 1)) == 2
    cfg.cluster.num_trainers = 3
    assert elastic_grad_accum(cfg, _meta(2, 3)) == 2
    with pytest.raises(ValueError, match=r"global batch is 2 .* use \[1, 2\] trainers"):
        elastic_grad_accum(cfg, _meta(2, 1))
    cfg.cluster.num_trainers, cfg.train.grad_accum = 1, 1
    adapted = adapt_to_checkpoint(cfg, _meta(4, 1), logging.getLogger("test"))
    assert adapted.train.grad_accum == 4 and cfg.train.grad_accum == 1  # a new config; the given one is unchanged
    assert adapted.cluster == cfg.cluster and adapted.draft == cfg.draft
    check_stage(cfg, _meta(2, 1, stage=3))  # every stage reshards (ELASTIC_STAGES); a stage taken out of it:
    monkeypatch.setattr("workers.trainer.reshard.ELASTIC_STAGES", (0, 1, 2))
    cfg.train.zero_stage = 3
    with pytest.raises(ValueError, match=r"with ZeRO stage \[2, 3\]: elastic resume supports stages \[0, 1, 2\]"):
        check_stage(cfg, _meta(2, 1))
    check_stage(cfg, _meta(1, 4, stage=3))  # same world size: resumes as before


@pytest.mark.slow
def test_launch_two_to_one_to_two_trainers_on_one_run_dir(tmp_path):
    """Through the real launch script (Ray FeatureService, tiny Qwen3-MoE target, ZeRO-2): one --run-dir trained by
    2 trainers to step 2, by 1 to step 4, by 2 again to step 6; every step trains the same tokens and logs the
    uninterrupted 2-trainer run's loss to 1e-6. train.min_lr_ratio=1 makes the schedule independent of --max-steps
    (a constant LR after the warmup), so stopping early with --max-steps changes nothing else. The MoE balance bias
    is on (the default): it moves once per optimizer step from the global batch's load, so the split into
    trainers x grad_accum does not change it. About 8 minutes on a busy 2-core machine."""
    from launch_helpers import TINY_MOE, run_launch

    from pipeline.metrics import read_jsonl_metrics

    common = [*TINY_MOE, "checkpoint.every_steps=2", "checkpoint.keep_last=3", "checkpoint.export=false",
              "train.min_lr_ratio=1.0"]
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    res = run_launch(["--run-dir", str(straight), "--max-steps", "6", *common])
    assert res.returncode == 0, res.stderr[-4000:]
    logs = {}
    for trainers, steps in ((2, 2), (1, 4), (2, 6)):
        res = run_launch(["--run-dir", str(elastic), "--max-steps", str(steps), *common,
                          f"cluster.num_trainers={trainers}"])
        assert res.returncode == 0, res.stderr[-4000:]
        logs[trainers, steps] = res.stdout + res.stderr
    assert "elastic resume: 1 trainers x grad_accum 2 (checkpoint: 2 x 1, global batch 2)" in logs[1, 4]
    assert "elastic resume: 2 trainers x grad_accum 1 (checkpoint: 1 x 2, global batch 2)" in logs[2, 6]

    a, b = read_jsonl_metrics(straight / "metrics.jsonl"), read_jsonl_metrics(elastic / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    worst = max(abs(b[s]["loss"] / a[s]["loss"] - 1) for s in a)
    print(f"launch 2 -> 1 -> 2 trainers: worst relative loss difference {worst:.2e}")
    for s in a:
        assert b[s]["trained_tokens"] == a[s]["trained_tokens"], s  # the same global batch, token for token
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-6), (s, a[s]["loss"], b[s]["loss"], worst)
    for step, world, ga in ((2, 2, 1), (4, 1, 2), (6, 2, 1)):
        meta = json.loads((elastic / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())
        pos = meta["data_position"]
        assert (pos["next_batch_index"], pos["world_size"], pos["grad_accum"]) == (2 * step, world, ga)
    # the universal copy of the last checkpoint read across a world-size change, outside checkpoints/
    assert [p.name for p in (elastic / "reshard").iterdir()] == ["step_00000004"]
    assert json.loads((elastic / "reshard" / "step_00000004" / "source.json").read_text())["world_size"] == 1


def test_launch_refuses_a_trainer_count_that_does_not_divide_the_global_batch(tmp_path):
    """One line, exit status 2, before Ray starts: the driver checks the checkpoint's meta.json first."""
    from launch_helpers import TINY_MOE, run_launch

    from workers.trainer.checkpoint import write_manifest

    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    cfg = _run_cfg()
    cfg.cluster.num_trainers = 2
    (step / "meta.json").write_text(json.dumps({**_meta(2, 1), "step": 2, "config": cfg.to_dict()}))
    write_manifest(step)  # sealed as save() seals one: a checkpoint without its manifest is refused first
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    res = run_launch(["--run-dir", str(tmp_path), *TINY_MOE, "cluster.num_trainers=3"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "error: cannot resume on 3 trainers: the checkpoint's global batch is 2 feature batches per step "
        "(2 trainers x grad_accum 1); use [1, 2] trainers")


def test_library_code_unpickles_nothing_it_loads():
    """Every torch.load in library code passes weights_only=True (the universal copies under <run_dir>/reshard/
    included: workers/trainer/reshard.load_universal_file); what DeepSpeed itself unpickles is docs/fault-tolerance.md's
    trust boundary."""
    import ast

    repo = Path(__file__).resolve().parents[1]
    loads = []
    for package in ("draft_model", "pipeline", "serving", "workers", "evaluation"):
        for path in (repo / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    flag = {k.arg: k.value for k in node.keywords}.get("weights_only")
                    safe = isinstance(flag, ast.Constant) and flag.value is True
                    loads.append((f"{path.relative_to(repo)}:{node.lineno}", safe))
    assert len(loads) >= 5, loads  # the checker sees the loads there are
    assert [where for where, safe in loads if not safe] == []


def test_an_elastic_group_keeps_the_launched_global_batch():
    """cluster.min_trainers (issue #46): a trainer group Ray Train formed at another size sets grad_accum to the
    launched global batch over its size, so each step trains the same feature batches; the config refuses a
    min_trainers that allows a size not dividing the global batch."""
    from pipeline.config import load_config
    from workers.trainer.reshard import elastic_world

    cfg = load_config(None, ["cluster.num_trainers=4", "train.grad_accum=3", "cluster.min_trainers=2"])  # 12: 2, 3, 4
    two = elastic_world(cfg, 2)
    assert (two.train.grad_accum, two.cluster.num_trainers) == (6, 2)
    assert (cfg.train.grad_accum, cfg.cluster.num_trainers) == (3, 4)  # the launched config is left as it was
    for step in (0, 5):
        assert sorted(batch_index_for(step, m, r, 6, 2) for r in range(2) for m in range(6)) == \
            sorted(batch_index_for(step, m, r, 3, 4) for r in range(4) for m in range(3)) == \
            list(range(12 * step, 12 * step + 12))
    with pytest.raises(ValueError, match=r"global batch \(train.grad_accum x cluster.num_trainers = 4\).*\[3\] do not"):
        load_config(None, ["cluster.num_trainers=4", "train.grad_accum=1", "cluster.min_trainers=2"])
    with pytest.raises(ValueError, match=r"cluster.min_trainers \(3\) must be at most cluster.num_trainers \(2\)"):
        load_config(None, ["cluster.num_trainers=2", "cluster.min_trainers=3"])
