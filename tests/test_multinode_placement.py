"""The production presets placed at the topology they name, on a simulated multi-node Ray cluster
(bench/sim_cluster.py): one raylet per KubeRay pod of k8s/rayjob-v4.yaml's shape, each with that pod's logical GPUs,
CPUs and custom resources (`target_worker`, `trainer`), a head with none. The launcher's own placement runs there:
each vLLM replica's engine actor (and, with vLLM's "ray" executor, its placement group) from
workers/frozen_target/vllm_worker.py's `engine_actor_options` / `engine_placement_group`, the trainers from
workers/driver.trainer_scaling_config through a real Ray Train worker group. What would load a model is swapped for
a probe that reports where it runs and which GPUs Ray gave it: no vLLM engine and no DeepSeek-V4 target run here (a
CPU machine), so what is checked is the Ray placement, not the engines. Asserted from Ray's state API: every
replica's ranks on one node (or on the two nodes the tp 16 variant spans), trainers on trainer nodes, no logical GPU
given twice, every GPU given, nothing pending.

Run: python -m pytest tests/test_multinode_placement.py -q -m slow   (all three are slow: v4-flash, 3 worker nodes,
     40 s on 2 cores alone; v4-pro (6 nodes) and v4-pro at tp 16 over two nodes per replica (10 nodes), ~6 min more)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from launch_helpers import REPO
from sim_cluster import SimCluster, manifest_nodes

from pipeline.config import load_config

MANIFEST = yaml.safe_load((REPO / "k8s" / "rayjob-v4.yaml").read_text())


def _probe_cls():
    import ray

    @ray.remote
    class Probe:
        """Stands in for a vLLM engine (or one of its ray-executor workers): where it runs, which GPUs it has."""

        def where(self) -> tuple[str, list[str]]:
            return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    return Probe


def _report_placement(config: dict) -> None:
    """A trainer rank of the real Ray Train worker group: writes where it runs, then waits to be released."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    out = Path(config["dir"])
    (out / f"rank{ctx.get_world_rank()}.json").write_text(json.dumps(
        {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()]}))
    deadline = time.time() + 300
    while not (out / "release").exists() and time.time() < deadline:
        time.sleep(0.2)


def _place(preset: str, overrides: list[str], replicas: dict[str, int], tmp_path: Path) -> None:
    import ray
    from ray.train import RunConfig as RayRunConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors, list_placement_groups

    from workers.driver import check_cluster_fits, trainer_scaling_config
    from workers.frozen_target.vllm_worker import engine_actor_options, engine_placement_group

    cfg = load_config(REPO / "launch" / "configs" / f"{preset}.yaml", overrides)
    t = cfg.target
    target = {**t.__dict__, "vllm_python": sys.executable}  # the probe runs in this environment, not vLLM's
    ranks = t.tp_size * t.pp_size
    sim = SimCluster(head_cpus=0)  # the manifest's head: no CPUs, no GPUs, no custom resources
    try:
        pods = manifest_nodes(MANIFEST, replicas)
        kinds = {}
        for name, resources in pods:
            kinds[sim.add(name, **resources)] = name.rsplit("-", 1)[0]
        # the workers import this checkout, this module (the trainers' function) and bench/ (its imports)
        path = ":".join(str(p) for p in (REPO, REPO / "tests", REPO / "bench"))
        ray.init(address=sim.address, runtime_env={"env_vars": {"PYTHONPATH": path}})
        check_cluster_fits(cfg, [n["Resources"] for n in ray.nodes() if n["Alive"]])  # the launcher's own check

        # the target replicas, as workers/frozen_target/vllm_worker.start_engine places them
        Probe = _probe_cls()
        replicas_at: list[list[tuple[str, list[str]]]] = []
        held = []  # the actors' handles: an actor whose last handle goes is killed, and its GPUs freed
        for i in range(t.num_workers):
            pg = engine_placement_group(target, f"placement-test-{i}")
            engine = Probe.options(**engine_actor_options(target, pg)).remote()
            held.append(engine)
            if pg is None:  # vLLM's "mp" executor: the engine actor holds the replica's GPUs, its workers are its
                replicas_at.append([ray.get(engine.where.remote(), timeout=120)])  # own processes
                continue
            # vLLM's "ray" executor: one worker actor per engine rank, on that rank's GPU bundle
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            ray.get(engine.where.remote(), timeout=120)
            workers = [Probe.options(num_cpus=0, num_gpus=t.gpus_per_worker, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))).remote() for r in range(ranks)]
            held += workers
            replicas_at.append(ray.get([w.where.remote() for w in workers], timeout=120))

        # the trainers, as workers/driver.run_training's TorchTrainer places them (the same ScalingConfig)
        out = tmp_path / "trainers"
        out.mkdir()
        trainer = DataParallelTrainer(_report_placement, train_loop_config={"dir": str(out)},
                                      scaling_config=trainer_scaling_config(cfg),
                                      run_config=RayRunConfig(storage_path=str(tmp_path / "ray_train"), name="p"))
        fit = threading.Thread(target=trainer.fit, daemon=True)
        fit.start()
        deadline = time.time() + 300
        while len(list(out.glob("rank*.json"))) < cfg.cluster.num_trainers:
            assert time.time() < deadline and fit.is_alive(), "the trainer group did not start"
            time.sleep(0.5)
        trainers = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]

        # every replica's ranks on one node as the preset says, or on the nodes its tp spans; target nodes only
        gpus_per_pod = next(r["num_gpus"] for name, r in pods if name.startswith("target-workers"))
        for at in replicas_at:
            nodes = {n for n, _ in at}
            assert len(nodes) == max(1, ranks * t.gpus_per_worker // gpus_per_pod), at
            assert {kinds[n] for n in nodes} == {"target-workers"}, at
            assert sum(len(g) for _, g in at) == ranks * t.gpus_per_worker, at
        # trainers on trainer nodes, one GPU each, filling them
        assert Counter(kinds[r["node"]] for r in trainers) == {"trainers": cfg.cluster.num_trainers}
        assert all(len(r["gpus"]) == 1 for r in trainers), trainers
        # no logical GPU given twice, and every GPU of the cluster given
        booked = [(n, g) for at in replicas_at for n, gpus in at for g in gpus] + \
                 [(r["node"], g) for r in trainers for g in r["gpus"]]
        assert len(booked) == len(set(booked)), Counter(booked).most_common(3)
        assert len(booked) == sum(int(r["num_gpus"]) for _, r in pods)
        deadline = time.time() + 30  # the GCS's view of free resources follows the raylets' reports
        while ray.available_resources().get("GPU", 0) and time.time() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("GPU", 0) == 0, ray.available_resources()
        # nothing pending: every actor alive (Ray Train's own included), every placement group created
        states = Counter(a.state for a in list_actors(address=sim.dashboard, limit=1000))
        assert set(states) == {"ALIVE"}, states
        pgs = list_placement_groups(address=sim.dashboard, limit=1000)
        assert pgs and {p.state for p in pgs} == {"CREATED"}, [(p.name, p.state) for p in pgs]
        assert all(v["state"] == "CREATED" for v in placement_group_table().values())
        (out / "release").touch()
        fit.join(timeout=120)
        assert not fit.is_alive()
    finally:
        sim.stop()


@pytest.mark.slow  # alone 36 s; three times in the full parallel suite its first probe actor was "cancelled before
# it started running" (cause not found; the two files beside it then, run beside it alone, pass): kept out of CI's run
def test_v4_flash_places_at_its_topology(tmp_path):
    """k8s/rayjob-v4.yaml as it is: 2 target pods of 8 GPUs (one replica each, tp 8, vLLM "mp"), 1 trainer pod of
    8 GPUs (8 trainers)."""
    _place("v4-flash", [], {}, tmp_path)


@pytest.mark.slow
def test_v4_pro_places_at_its_topology(tmp_path):
    """v4-pro on pods of the same shape: 4 target pods (one tp 8 replica each), 2 trainer pods (16 trainers)."""
    _place("v4-pro", [], {"target-workers": 4, "trainers": 2}, tmp_path)


@pytest.mark.slow
def test_v4_pro_at_tp16_spans_two_nodes_per_replica(tmp_path):
    """v4-pro on 80 GiB GPUs: tp 16 over two 8-GPU pods per replica with vLLM's "ray" executor (8 target pods)."""
    _place("v4-pro", ["target.tp_size=16", "target.vllm_executor=ray"], {"target-workers": 8, "trainers": 2},
           tmp_path)
