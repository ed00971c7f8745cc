"""The driver's side of a run: inputs (workers/inputs.py), resume checks (pipeline/resume.py), the cluster fit, the
feature service, then Ray Train + DeepSpeed; and how this process connects to Ray.

`run_training` never branches on how it was launched (local Ray, `ray job submit`, KubeRay): the caller only
passes how to connect. Problems the user can fix (bad data, a draft that does not fit the target, a resume that
does not match the checkpoint) raise InputError before any worker starts or any checkpoint is touched.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.config import RunConfig, save_config
from pipeline.errors import InputError
from pipeline.metrics import drop_log_message
from pipeline.resume import check_resume, check_samples
from workers.inputs import resolve_inputs, write_run_samples
from workers.lease import Fence

# the checkout this module runs from; Ray workers started by this driver import the same code (worker_runtime_env)
REPO = Path(__file__).resolve().parents[1]


class TrainingFailed(RuntimeError):
    """A trainer failed in a way no restart fixes; the message is the trainer's error, one line."""


def check_cluster_fits(cfg: RunConfig, nodes: list[dict[str, float]]) -> None:
    """InputError (one line) when the connected cluster cannot hold the target groups and trainers the config asks
    for: in total, and each group on one node (its placement group is STRICT_PACK). `nodes` holds each live node's
    total resources (ray.nodes()'s "Resources"). A cluster that grows (an autoscaler) is not foreseen here."""
    t, c = cfg.target, cfg.cluster
    vllm = t.backend == "vllm"
    # a vLLM replica: tp x pp GPUs, and one engine actor's CPUs; vLLM's "ray" executor may span nodes
    ranks = t.tp_size * (t.pp_size if vllm else 1)
    group = {"GPU": ranks * t.gpus_per_worker, "CPU": t.cpus_per_worker if vllm else t.tp_size * t.cpus_per_worker}
    one_node = ranks > 1 and (not vllm or t.vllm_executor != "ray")
    # how one group's need is made up, per resource, in the config's keys
    ranks_keys = f"target.tp_size={t.tp_size}" + (f" x target.pp_size={t.pp_size}" if vllm else "")
    made_of = {"GPU": f"{ranks_keys} x target.gpus_per_worker={t.gpus_per_worker:g}",
               "CPU": (f"target.cpus_per_worker={t.cpus_per_worker:g}" if vllm
                       else f"target.tp_size={t.tp_size} x target.cpus_per_worker={t.cpus_per_worker:g}")}
    trainers = {"GPU": c.num_trainers * (1.0 if c.use_gpu else 0.0), "CPU": c.num_trainers * c.cpus_per_trainer}
    for kind in ("GPU", "CPU"):
        have = sum(n.get(kind, 0.0) for n in nodes)
        need = t.num_workers * group[kind] + trainers[kind]
        if need > have + 1e-9:
            raise InputError(f"the run needs {need:g} {kind}s (target.num_workers={t.num_workers} x {made_of[kind]}, "
                             f"plus {trainers[kind]:g} for {c.num_trainers} trainer(s)) but the Ray cluster has "
                             f"{have:g}")
        biggest = max((n.get(kind, 0.0) for n in nodes), default=0.0)
        if one_node and group[kind] > biggest + 1e-9:
            raise InputError(f"a target group needs {group[kind]:g} {kind}s on one node ({made_of[kind]}) but the "
                             f"largest node has {biggest:g}")


def trainer_scaling_config(cfg: RunConfig):
    """Ray Train's ScalingConfig of the trainer group: where each trainer rank goes (its CPUs, its GPU, the custom
    resources that keep it on trainer nodes). The one place the trainers' placement is decided; the multi-node
    placement test (tests/test_multinode_placement.py) runs the same one."""
    from ray.train import ScalingConfig

    c = cfg.cluster
    # elastic (cluster.min_trainers): Ray Train restarts a group that lost a trainer on the ones it can place now,
    # and grows it back when more fit (it looks every cluster.elastic_resize_s)
    elastic = 0 < c.min_trainers < c.num_trainers
    return ScalingConfig(num_workers=(c.min_trainers, c.num_trainers) if elastic else c.num_trainers,
                         use_gpu=c.use_gpu, elastic_resize_monitor_interval_s=c.elastic_resize_s,
                         resources_per_worker={"CPU": c.cpus_per_trainer, **c.resources_per_trainer})


def worker_runtime_env(address: str = "") -> dict | None:
    """Ray workers must import this repo. Under `ray job submit --working-dir` the job's runtime env already
    ships it; a driver started by hand points the workers at its checkout (same filesystem: local or shared).
    A GCS `address` (host:port) is passed on as RAY_ADDRESS: Ray Train's own helper actors look the cluster up
    without one, and fail with a traceback ('Found multiple active Ray instances') on a node that runs two."""
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return None
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    if address and "://" not in address and address not in ("auto", "local"):
        env["RAY_ADDRESS"] = address
    return {"env_vars": env}


def connect_ray(cfg) -> None:
    import ray

    from workers.loopback import local_ray_on_loopback

    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, runtime_env=worker_runtime_env(address))
        return
    runtime_env = worker_runtime_env()
    t, c = cfg.target, cfg.cluster
    needed = t.num_workers * t.tp_size * t.cpus_per_worker + c.num_trainers * c.cpus_per_trainer
    num_cpus = cfg.cluster.local_num_cpus or max(os.cpu_count() or 1, int(needed + 0.999))
    # The dashboard also serves the state API that Ray Train's controller polls (without it, it logs a warning
    # every few seconds); it binds to loopback unless cluster.dashboard_host says otherwise. Everything else binds to
    # loopback too (workers/loopback.py).
    local_ray_on_loopback()
    # Ray 2.60 turns token authentication on for a new local cluster and says so each time; this one listens on
    # loopback only (workers/loopback.py). Its "disabled" warning, and every other line of that logger, stay.
    drop_log_message("ray._private.authentication.authentication_token_setup",
                     "Token authentication is enabled for this Ray cluster.")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host=c.dashboard_host,
             runtime_env=runtime_env)
    replace_stale_cluster_file(ray.get_runtime_context().gcs_address)


def replace_stale_cluster_file(address: str, path: str | os.PathLike | None = None) -> bool:
    """Point Ray's "current cluster" file (/tmp/ray/ray_current_cluster, written by `ray start`) at this run's
    local cluster when the head it names is gone. Ray Train's placement-group cleaner looks the cluster up without
    an address, through that file: a file left by a killed `ray start` makes it time out with a traceback on an
    otherwise healthy run. A file naming a live head (another user's cluster) is left alone. True when replaced."""
    from ray._private.utils import get_ray_address_file

    from workers.node_loss import head_answers

    path = Path(path or get_ray_address_file(None))
    try:
        if head_answers(path.read_text(), timeout=1.0):
            return False  # a live head
    except (OSError, ValueError):
        return False  # no file, or not an address Ray would read either
    path.write_text(address)
    return True


def run_training(cfg: RunConfig, resume_from: Path | None, connect: Callable[[], None],
                 log: logging.Logger, fence: Fence | None = None) -> None:
    """Train to the end, or raise StoppedEarly after a stop request (SIGTERM/SIGINT on this process, or on a
    trainer: workers/run_control.py) once every trainer has checkpointed the same step. `fence`: the run dir's
    lease as this driver holds it (workers/lease.py); the trainers check it every step and before every commit."""
    import json

    import ray
    from ray.train import FailureConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchTrainer

    from workers.frozen_target.feature_cache import open_feature_cache
    from workers.frozen_target.feature_service import FeatureService
    from workers.preemption import StoppedEarly, stop_on_signal
    from workers.run_control import RunControl, prepare_ray_train
    from workers.trainer.process_group import trainer_torch_config
    from workers.trainer.ray_trainer import train_loop
    from workers.trainer.reshard import adapt_to_checkpoint

    meta = json.loads((resume_from / "meta.json").read_text()) if resume_from is not None else None
    if meta is not None:
        try:  # another trainer count: keep the checkpoint's global batch (workers/trainer/reshard.py)
            cfg = adapt_to_checkpoint(cfg, meta, log)
        except ValueError as e:
            raise InputError(str(e)) from e
        check_resume(cfg, meta)
    target_path, samples = resolve_inputs(cfg, log, in_memory=False)  # a Parquet source stays on disk
    run_dir = Path(cfg.checkpoint.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_path, samples_digest = write_run_samples(samples, run_dir)
    if meta is not None:
        check_samples(meta, samples_digest)
    num_samples = len(samples)
    del samples  # the feature service reads them back by id; the driver need not hold the dataset

    connect()
    check_cluster_fits(cfg, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    # the run's own actors stay on the driver's node (the head under `ray job submit`), as Ray Train pins its
    # controller there: a worker node that dies takes its target replicas and trainers, never the service that
    # re-creates them or the stop switch. Hard affinity: a soft one put these zero-CPU actors on a worker node when
    # the head has no CPUs (the KubeRay head's num-cpus 0; measured on bench/sim_cluster.py)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    control = RunControl.options(scheduling_strategy=here).remote()
    # max_seq_len: the longest sequence a target forward holds, for its memory check (workers/frozen_target/sizing.py)
    target = {**cfg.target.__dict__, "resolved_path": str(target_path), "max_seq_len": cfg.data.max_len}
    cache = open_feature_cache(cfg, samples_digest, target_path, log)
    service = FeatureService.options(max_restarts=-1, max_task_retries=-1, scheduling_strategy=here).remote(
        str(samples_path), target, list(cfg.draft.target_layers), cfg.data.samples_per_batch, cfg.data.seed,
        cfg.data.max_in_flight, cfg.data.replay_batches, cache)
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

    prepare_ray_train()  # nothing at the trainer group's start that prints a failure on a healthy run
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.to_dict(), "service": service, "control": control,
                           "weights_ref": weights_ref, "num_samples": num_samples, "samples_digest": samples_digest,
                           "fence": fence},
        torch_config=trainer_torch_config(ray.nodes()),  # a local cluster's process group on loopback
        scaling_config=trainer_scaling_config(cfg),
        run_config=RayRunConfig(storage_path=str(run_dir / "ray_train"), name="train",
                                failure_config=FailureConfig(max_failures=cfg.cluster.max_failures)),
    )
    try:
        with stop_on_signal(lambda name: control.request_stop.remote(name)):
            fit_watching_capacity(trainer, cfg, log)
        fatal, reason = ray.get([control.fatal_error.remote(), control.stop_reason.remote()])
        if fatal is not None:  # the retried trainer group returned at once (workers/trainer/ray_trainer.train_loop)
            raise TrainingFailed(fatal)
    finally:
        if cache:
            stats = ray.get(service.stats.remote())
            log.info("feature cache: %d feature batches read from %s instead of the target", stats["from_cache"],
                     cache)
        ray.get(service.shutdown.remote())
        ray.kill(service, no_restart=True)
    if reason is not None:
        from workers.trainer.checkpoint import CheckpointManager

        # the trainers verified and wrote it just now: sizes are enough to find its step
        latest = CheckpointManager(run_dir, cfg.checkpoint.keep_last).latest(verify="size")
        step = int(json.loads((latest / "meta.json").read_text())["step"]) if latest else 0
        if step < cfg.train.max_steps:  # else the request came during the last step: the run is complete
            raise StoppedEarly(step, cfg.train.max_steps)


def fit_watching_capacity(trainer, cfg: RunConfig, log: logging.Logger, poll_s: float = 5.0) -> None:
    """`trainer.fit()` in a thread of its own while this (main) thread watches whether the live nodes still hold the
    trainer group (workers/trainer_capacity.py): TrainersUnplaceable after cluster.trainer_wait_s without; and whether
    the head still answers: a driver off the head that outlives it ends with one line and UNAVAILABLE_EXIT after
    HEAD_LOST_S (Ray itself would end it a minute later, exit 1, after a minute of its own errors). Off the
    main thread Ray Train installs no SIGINT handler of its own, so Ctrl-C stays the checkpoint-then-stop of
    stop_on_signal, as SIGTERM is."""
    import threading

    import ray

    from workers.node_loss import HEAD_LOST_S, head_answers
    from workers.trainer_capacity import UNAVAILABLE_EXIT, CapacityWatch, trainer_need, trainer_slots

    c = cfg.cluster
    need = trainer_need(c.use_gpu, c.cpus_per_trainer, c.resources_per_trainer)
    elastic = 0 < c.min_trainers < c.num_trainers
    watch = CapacityWatch(c.min_trainers if elastic else c.num_trainers, need, c.trainer_wait_s, log,
                          "the elastic group's minimum (cluster.min_trainers)" if elastic
                          else "the trainer group (cluster.num_trainers)")
    outcome: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # handed to the main thread, raised there
            outcome.append(e)

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)  # daemon: never holds the exit
    thread.start()
    gcs, unreachable_since = ray.get_runtime_context().gcs_address or "", None
    if gcs.count(":") != 1:  # not a host:port this process can probe (not seen with ray.init): no head watch
        gcs = ""
    while True:
        thread.join(poll_s)
        if gcs and not head_answers(gcs):  # the head is gone (a driver off the head outlives it)
            if not thread.is_alive():  # fit's error is the head's loss (Ray Train's controller lived there)
                time.sleep(1.0)
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since >= HEAD_LOST_S:
                # no unwinding: every call into Ray now blocks for a minute, then Ray ends this process (exit 1)
                print(f"error: lost the Ray head: its GCS at {gcs} has not answered for {now - unreachable_since:.0f}"
                      " s; the run cannot go on without it: a resubmission of the same command (a RayJob's or Job's "
                      "backoffLimit) resumes from the newest checkpoint", file=sys.stderr, flush=True)
                os._exit(UNAVAILABLE_EXIT)
            continue
        unreachable_since = None
        if not thread.is_alive():
            break
        watch.poll(trainer_slots([n["Resources"] for n in ray.nodes() if n.get("Alive")], need), time.monotonic())
    if outcome:
        raise outcome[0]


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
