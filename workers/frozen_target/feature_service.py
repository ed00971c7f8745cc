"""The feature service: one Ray actor that owns the frozen-target workers and hands feature batches to trainers.

Trainers ask for batch b (pipeline/order.py says which b each rank needs at each step); the service returns an
ObjectRef to a FeatureBatch produced by one of its target workers. It keeps at most `max_in_flight` batches
produced ahead of the lowest batch not yet handed out, so the target never runs unboundedly ahead of the
trainers (backpressure) and memory stays flat. Tensors never pass through this actor: it only moves references.

Faults. A batch is a pure function of its index (its samples come from pipeline/order.py, read by id from the
run's samples file), so every recovery is a re-run, never a replay of a queue:
- a target worker that dies is restarted by Ray (`target.max_restarts`) and the encode calls it had in flight are
  re-run on the restarted worker (`max_task_retries`); a trainer waiting on such a batch simply waits longer;
- a vLLM target (target.backend=vllm, workers/frozen_target/vllm_worker.py) is restarted like a worker;
- a target group (target.tp_size > 1, workers/frozen_target/group.py) that loses a member is restarted whole on the next
  call it gets; its calls in flight fail, and their trainers ask for those batches again (the next point);
- `get` is idempotent: a batch asked for again (a trainer group restarted from a checkpoint, or a trainer whose
  reference was lost) is produced again, and the prefetch window restarts from it;
- a whole node lost (workers/node_loss.py: the GCS declares it dead; no signal reaches anything on it): a
  thread of the service polls the nodes every NODE_POLL_S; the target replica that lived there is killed for good
  (a restartable actor would otherwise wait, with the batches queued on it, for a node with its resources that may
  never come), so every call in flight on it fails and its trainers ask again (the previous point); the batches it
  had prefetched are launched again on the replicas left, and a replacement is started at once, which Ray places
  when a node with its resources joins. Until then the service hands out batches from the replicas left (all of
  them queue on the replacement when none is left), and says so once a minute;
- the service itself restarts with its constructor arguments, which name the samples file instead of holding
  the dataset; its state (what was prefetched) is only an optimisation.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from pipeline.order import batch_sample_ids
from pipeline.sample_store import SampleStore
from workers.frozen_target.feature_cache import has_all, read_batch
from workers.frozen_target.group import TargetGroup
from workers.frozen_target.vllm_worker import VllmTarget
from workers.node_loss import actor_node, dead_nodes, short

log = logging.getLogger(__name__)

NODE_POLL_S = 1.0  # how often the service looks for dead nodes (the GCS's own detection takes longer)
WAIT_LINE_S = 60.0  # while a lost replica waits for capacity, one line this often says so


@ray.remote(num_cpus=0)
def _read_cached(cache: str, batch_index: int, samples: list) -> Any:
    return read_batch(cache, batch_index, samples)


def target_worker_options(target: dict[str, Any]) -> dict[str, Any]:
    """Ray options of one target worker: its resources, and a restart (with its in-flight calls re-run) when it
    dies; an error raised by `encode` itself is not retried (it would fail the same way again)."""
    return {"num_cpus": target["cpus_per_worker"], "num_gpus": target["gpus_per_worker"],
            "resources": target["resources_per_worker"] or None,
            "max_restarts": target["max_restarts"], "max_task_retries": -1}


@ray.remote(num_cpus=0, max_concurrency=16)
class FeatureService:
    def __init__(self, samples_path: str, target: dict[str, Any], layers: list[int], samples_per_batch: int,
                 seed: int, max_in_flight: int, replay_batches: int = 0, feature_cache: str | None = None) -> None:
        self._samples = SampleStore(samples_path)
        if not len(self._samples):
            raise ValueError(f"{samples_path} has no samples")
        self._spb, self._seed, self._max_in_flight = samples_per_batch, seed, max_in_flight
        self._replay = replay_batches
        self._cache = feature_cache  # a feature cache directory (workers/frozen_target/feature_cache.py), or None
        self._from_cache = 0
        self._replay_refs: list[ray.ObjectRef] = []
        self._target, self._layers = target, list(layers)
        self._workers = [self._start_worker(i) for i in range(target["num_workers"])]
        self._lock = threading.Lock()
        self._launched: dict[int, ray.ObjectRef] = {}
        self._launched_on: dict[int, int] = {}  # batch -> the worker (index) producing it, for the launched ones
        self._handed_out: set[int] = set()
        self._low = 0  # every batch below this was handed out
        self._next_worker = 0
        self._reissued = 0
        # node loss: the nodes each worker's actors were seen alive on; the workers being re-created after theirs
        # died: index -> [lost at, its replacement's first answer (ready when placed and loaded), last line at]
        self._seen: list[set[str]] = [set() for _ in self._workers]
        self._down: dict[int, list] = {}
        self._nodes_lost = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch_nodes, name="node-watch", daemon=True).start()

    def _start_worker(self, i: int) -> Any:
        """Target worker i as the config places it: a vLLM replica, a target group or one actor."""
        from workers.frozen_target.worker import TargetWorker

        target, layers = self._target, self._layers
        # backend vllm: each "worker" is a VllmTarget (one vLLM engine, its own parallelism); tp_size > 1: a
        # TargetGroup; both are called through the same .encode.remote(...) interface
        if target.get("backend") == "vllm":
            return VllmTarget(i, target, layers)
        if target["tp_size"] > 1:
            return TargetGroup(i, target, layers)
        gpus = target["gpus_per_worker"]
        # one GPU: the whole target on it; several: accelerate spreads its layers (device_map), invisible here
        placement = {"device_map": target["device_map"] or "auto"} if gpus > 1 else {
            "device": "cuda" if gpus > 0 else "cpu"}
        return ray.remote(TargetWorker).options(**target_worker_options(target)).remote(
            target["resolved_path"], layers, compute_dtype=target["dtype"], wire_dtype=target["wire_dtype"],
            max_tokens_per_forward=target["max_tokens_per_forward"], max_seq_len=target.get("max_seq_len"),
            **placement)

    def _actors(self, i: int) -> list[Any]:
        w = self._workers[i]
        return w.members() if isinstance(w, TargetGroup | VllmTarget) else [w]

    def target_info(self) -> dict[str, Any]:
        vocab, hidden, layers = ray.get(self._workers[0].info.remote())
        return {"vocab_size": vocab, "hidden_size": hidden, "num_layers": layers}

    def embedding_weights(self) -> list[ray.ObjectRef]:
        """[ref] to (embed_VD, lm_head_VD) CPU tensors; wrapped in a list so Ray does not resolve it here."""
        return [self._workers[0].embedding_weights.remote()]

    def get(self, batch_index: int) -> list[ray.ObjectRef]:
        """[ref] to FeatureBatch `batch_index`. Asking again for a batch already handed out produces it again
        (a restarted trainer re-reads from its checkpoint) and restarts the prefetch window there."""
        if self._replay:
            with self._lock:
                while len(self._replay_refs) < self._replay:
                    b = len(self._replay_refs)
                    self._launch(b)
                    self._replay_refs.append(self._launched.pop(b))
            return [self._replay_refs[batch_index % self._replay]]
        with self._lock:
            if batch_index < self._low or batch_index in self._handed_out:
                self._reissued += 1
                self._low, self._handed_out = batch_index, set()
                # prefetched batches at or past the rewind point stay valid; older ones will not be asked for
                self._launched = {b: r for b, r in self._launched.items() if b >= batch_index}
            self._launch(batch_index)
            ref = self._launched.pop(batch_index)
            self._handed_out.add(batch_index)
            while self._low in self._handed_out:
                self._handed_out.discard(self._low)
                self._low += 1
            # prefetch ahead of the slowest consumer, never more than max_in_flight batches past it
            for b in range(self._low, self._low + self._max_in_flight):
                if b not in self._handed_out:
                    self._launch(b)
        return [ref]

    def _launch(self, b: int) -> None:
        if b in self._launched:
            return
        ids = batch_sample_ids(b, len(self._samples), self._spb, self._seed)
        if self._cache and has_all(self._cache, ids):  # read by a task, so tensors never pass through this actor
            self._from_cache += 1
            self._launched[b] = _read_cached.remote(self._cache, b, self._samples.take(ids))
            return
        # round robin over the workers not waiting for a node; over all when none is left (the batch then queues on
        # a replacement and runs once it is placed)
        live = [i for i in range(len(self._workers)) if i not in self._down] or list(range(len(self._workers)))
        i = live[self._next_worker % len(live)]
        self._next_worker += 1
        self._launched[b] = self._workers[i].encode.remote(b, self._samples.take(ids), self._cache)
        self._launched_on[b] = i

    def _watch_nodes(self) -> None:
        while not self._stop.wait(NODE_POLL_S):
            try:
                self._check_nodes()
            except Exception as e:  # noqa: BLE001 - the GCS busy or restarting: look again at the next poll
                log.debug("node check failed: %s", e)

    def _check_nodes(self) -> None:
        dead = dead_nodes()
        for i in range(len(self._workers)):
            if i in self._down:
                self._check_replacement(i)
                continue
            now = [actor_node(a) for a in self._actors(i)]
            self._seen[i] |= {n for n in now if n}
            # lost: an actor of this worker is not alive, and a node it lived on is dead (an actor that crashed on a
            # live node is Ray's to restart, in place, with its calls re-run; one already restarted elsewhere is fine)
            lost = self._seen[i] & dead
            if lost and None in now:
                self._replace(i, sorted(lost))

    def _replace(self, i: int, nodes: list[str]) -> None:
        old = self._actors(i)
        for a in old:  # its calls in flight fail now (the trainers ask again) instead of waiting for a restart
            ray.kill(a, no_restart=True)
        if isinstance(self._workers[i], TargetGroup | VllmTarget):
            self._workers[i].kill()  # its placement group too
        with self._lock:
            again = [b for b, w in self._launched_on.items() if w == i and b in self._launched]
            for b in again:  # prefetched there, not handed out yet: launched again on the workers left
                del self._launched[b]
            self._launched_on = {b: w for b, w in self._launched_on.items() if w != i}
            self._workers[i] = self._start_worker(i)
            self._seen[i] = set()
            self._down[i] = [time.time(), self._workers[i].info.remote(), time.time()]
            left = len(self._workers) - len(self._down)
            for b in again:
                if b >= self._low:
                    self._launch(b)
        self._nodes_lost += len(nodes)
        log.warning("lost node %s (target worker %d on it): training goes on with %d of %d target worker(s); %d "
                    "prefetched batch(es) re-issued to them, batches in flight there are asked for again by their "
                    "trainers; target worker %d is re-created when a node with %s joins", ",".join(map(short, nodes)),
                    i, left, len(self._workers), len(again), i, self._needs())

    def _check_replacement(self, i: int) -> None:
        since, ready, said = self._down[i]
        done, _ = ray.wait([ready], timeout=0, fetch_local=False)
        now = time.time()
        if done:
            with self._lock:
                del self._down[i]
            log.warning("target worker %d re-created %.0f s after its node was lost: %d of %d target worker(s) "
                        "serving", i, now - since, len(self._workers) - len(self._down), len(self._workers))
        elif now - said >= WAIT_LINE_S:
            self._down[i][2] = now
            log.warning("target worker %d still waiting for a node with %s (lost %.0f s ago); %d of %d target "
                        "worker(s) serving", i, self._needs(), now - since, len(self._workers) - len(self._down),
                        len(self._workers))

    def _needs(self) -> str:
        """What one target worker asks of a node, in Ray's resource names."""
        t = self._target
        ranks = t["tp_size"] * (t.get("pp_size", 1) if t.get("backend") == "vllm" else 1)
        per_rank = {"GPU": t["gpus_per_worker"], **(t["resources_per_worker"] or {})}
        need = {k: v * ranks for k, v in per_rank.items() if v}
        need["CPU"] = t["cpus_per_worker"] * (1 if t.get("backend") == "vllm" else ranks)
        return "{" + ", ".join(f"{k}: {v:g}" for k, v in need.items()) + "}"

    def workers(self) -> list[Any]:
        """The target workers' handles (operators and fault tests); a target group's as the list of its members."""
        return [w.members() if isinstance(w, TargetGroup | VllmTarget) else w for w in self._workers]

    def in_flight(self) -> int:
        with self._lock:
            return len(self._launched)

    def stats(self) -> dict[str, int]:
        """How often a batch was asked for again (trainer restarts, lost references), and how many batches came
        from the feature cache instead of the target."""
        with self._lock:
            return {"reissued": self._reissued, "low": self._low, "from_cache": self._from_cache,
                    "nodes_lost": self._nodes_lost, "workers_down": len(self._down)}

    def shutdown(self) -> None:
        self._stop.set()
        # prefetched batches nobody will ask for: cancel the queued ones and give a running one a moment, so that
        # killing its worker is not logged as a task failure to retry
        pending = list(self._launched.values())
        for ref in pending:
            ray.cancel(ref)
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=5.0)
        for w in self._workers:
            w.kill() if isinstance(w, TargetGroup | VllmTarget) else ray.kill(w, no_restart=True)
