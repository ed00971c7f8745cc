"""Peak memory per trainer rank and per target rank at a preset's shapes, estimated without a GPU.

Run: python bench/memory.py                                  (v4-flash and v4-pro, a few minutes on a small CPU)
     python bench/memory.py --preset v4-pro --gpu-gib 80 target.tp_size=16 target.vllm_executor=ray  (other GPU)
     python bench/memory.py --preset v4-flash train.activation_checkpointing=false   (overrides as on the CLI)

Trainer: one rank's draft (bf16 parameters, the frozen embedding and LM head as the model stores them), one
micro-batch's forward and backward (a synthetic packed batch built with pipeline.packing.pack at the preset's
samples_per_batch x max_len tokens and anchors_per_seq, the chunked vocabulary loss included) and the ZeRO-2
optimizer state. The forward and backward run under torch's FakeTensorMode (shapes and dtypes, no memory, no
compute) inside torch's MemTracker, which records every tensor alive at the peak by kind, under a fake process group
of cluster.num_trainers ranks, as torchtitan's memory estimator does. What fake tensors
cannot know is supplied by `Hints`: expert routing is assumed balanced (each expert gets P/E rows; the sum, which
sets what the backward keeps, does not depend on it), the loss's validity checks pass, and the one `nonzero` (the
valid rows) gets the packed batch's real count. The CUDA kernel of the attention (flex attention, flex_layout.py)
has no CPU backward, so `FlexSaved` stands in for it with what its autograd keeps (q, k, v, out and the fp32
logsumexp) and returns gradients of the input shapes. Likewise RMSNorm: on CUDA torch 2.13 runs it as
`_fused_rms_norm`, whose backward reads only the input and the fp32 rstd [.., 1] (torch/_native/ops/norm/
rmsnorm_impl.py), where the CPU decomposition keeps three fp32 copies of the input; `RMSNormSaved` keeps what the
CUDA kernel keeps. The run is on fake *CPU* tensors (a CPU build of torch cannot make fake CUDA tensors by
`.to("cuda")`), with the CPU-only branches set to their CUDA form (`cuda_form`): those two stand-ins, attention
kernel "flex" (what "packed" picks on CUDA) and the loss's row blocks as wide as a chunk (loss.CACHE_BYTES).
Optimizer state (not run): ZeRO-2 as DeepSpeed sizes it (`estimate_zero2_model_states_mem_needs`): the fp32 master
copy, Adam's two moments and an fp32 gradient partition, 16 bytes per trainable parameter / cluster.num_trainers,
plus one gradient bucket (reduce_bucket_size, 5e8 elements in bf16, DeepSpeed's default).

The features of the rank's other micro-batches of the step and of the prefetched next step are added analytically
((2 grad_accum - 1) x [T, D] in the training dtype).

Target: `workers.frozen_target.sizing.target_memory(cfg, gpu_gib, model_config)` for the preset's backend: both
presets run the target on vLLM (target.backend=vllm), so one line is the largest rank of one vLLM engine of
tp_size x pp_size GPUs: its share of the weights as the checkpoint stores them (V4_STORED: vLLM keeps DeepSeek-V4's
FP8 / MXFP4 weights quantized) split as vLLM shards them, then above them (target_capture_gib) the KV cache vLLM
reserves whole (target.vllm_kv_cache_gib) and one prefill of target.max_tokens_per_forward tokens; fits=yes also
needs that KV cache to hold one engine step with its captured states (workers/frozen_target/sizing.py's
docstring). Estimates, not measured: no GPU has run either preset. model_config: DeepSeek-V4-Flash =
transformers 5.24's DeepseekV4Config defaults (43 layers, hidden 4096, 256 experts of 2048, top 6; its public card
says 284 B parameters); DeepSeek-V4-Pro = the public config.json values as third-party pages quote them (hidden
7168, 61 layers, 128 heads of 512, 1 KV head, q_lora_rank 1536, o_lora_rank 1024, 16 output groups, 384 experts
of 3072, top 6, 1 shared, 3 hash-routed layers: glennklockwood.com/garden/DeepSeek-V4-Pro,
apxml.com/models/deepseek-v4-pro, lab.feimatrix.com's V4-Pro report; the checkpoint stores experts in FP4 and the
rest in FP8 per the vLLM recipe page). Not read from the checkpoint. Other shapes by override, e.g.
`python bench/memory.py --preset v4-pro --gpu-gib 80 target.tp_size=16 target.vllm_executor=ray` (a replica over
two 8 x H100 nodes; read its "target rank" line: the v4-pro trainer itself needs more than 80 GiB).

Last lines, one per preset:
memory preset=P trainer_peak_gib=T target_weights_gib=W target_capture_gib=C gpu_gib=M fits=yes|no
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft_model.batch import BlockBatch  # noqa: E402
from draft_model.config import FINAL_HIDDEN  # noqa: E402
from pipeline.config import RunConfig, load_config  # noqa: E402
from pipeline.contracts import FeatureBatch  # noqa: E402
from pipeline.packing import pack  # noqa: E402

GIB = 2 ** 30
# the GPU each production preset is sized for (launch/configs/*.yaml headers): GiB of device memory
PRESET_GPU = {"v4-flash": ("H100", 80), "v4-pro": ("H200", 141)}
# bytes per trainable parameter of ZeRO-1/2 optimizer state, partitioned over the ranks: fp32 master + Adam m, v +
# fp32 gradient partition (DeepSpeed's estimate_zero2_model_states_mem_needs)
ZERO_STATE_BYTES = 16
REDUCE_BUCKET_ELEMS = 500_000_000  # DeepSpeed's default reduce_bucket_size (engines.py does not set it)
aten = torch.ops.aten


@dataclass
class TrainerMemory:
    params: int  # bytes, all of the draft's parameters and buffers (frozen embedding and head included)
    grads: int
    activations: int  # saved activations and temporaries at the peak
    optimizer: int  # ZeRO state of this rank (analytic)
    bucket: int  # one gradient reduce bucket (analytic)
    tracked_peak: int  # MemTracker's peak of the forward+backward (params + grads + activations at that moment)
    trainable: int  # parameters
    saved: list[tuple[str, int]]  # (shape and dtype, bytes) of every tensor autograd kept, largest first
    queued: int = 0  # the features of the step's other micro-batches and of the prefetched next step (analytic)

    @property
    def peak(self) -> int:
        return self.tracked_peak + self.optimizer + self.bucket + self.queued


class Hints(TorchDispatchMode):
    """Answers the data-dependent questions fake tensors cannot (see the module docstring). Sits above a
    FakeTensorMode; real values ride along in `self.value` for tensors made from real ones and their views."""

    _CARRY = {aten.select.int, aten.unbind.int, aten.stack.default, aten._to_copy.default, aten.clone.default,
              aten.alias.default, aten.view.default, aten.slice.Tensor, aten.lift_fresh.default}

    def __init__(self, fake_mode: FakeTensorMode, nonzero_rows: int | None) -> None:
        super().__init__()
        self.fake_mode, self.nonzero_rows = fake_mode, nonzero_rows
        self.value = WeakIdKeyDictionary()

    def fake(self, real: torch.Tensor) -> torch.Tensor:
        f = self.fake_mode.from_tensor(real)
        self.value[f] = real
        return f

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.bincount.default:  # expert loads: balanced routing
            x, E = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.empty(E, dtype=torch.int64, device=x.device)
            base, rem = divmod(x.numel(), E)
            with unset_fake_temporarily():
                self.value[out] = torch.tensor([base + (i < rem) for i in range(E)])
            return out
        if func is aten.nonzero.default:
            x = args[0]
            rows = self.nonzero_rows if self.nonzero_rows is not None else x.numel()
            return torch.empty(rows, x.dim(), dtype=torch.int64, device=x.device)
        if func is aten.allclose.default:  # the fused loss backward's check: the path a real step takes
            return True
        if func is aten._grouped_mm.default:  # its meta kernel takes bf16 only; the CPU kernel any float dtype
            return torch.empty(_grouped_mm_shape(args[0].shape, args[1].shape, args[2] if len(args) > 2 else
                                                 kwargs.get("offs")),
                               dtype=kwargs.get("out_dtype") or args[0].dtype, device=args[0].device)
        if func is aten._local_scalar_dense.default:
            x = args[0]
            if x in self.value:
                with unset_fake_temporarily():
                    return self.value[x].item()
            return True if x.dtype == torch.bool else (1.0 if x.is_floating_point() else 0)
        out = func(*args, **kwargs)
        if func in (aten.any.default, aten.any.dim):  # "is anything wrong": no
            with unset_fake_temporarily():
                self.value[out] = torch.zeros(out.shape, dtype=torch.bool)
        elif func in self._CARRY:
            self._carry(func, args, kwargs, out)
        return out

    def _carry(self, func, args, kwargs, out) -> None:
        def real(a):
            if isinstance(a, torch.Tensor):
                return self.value.get(a) if isinstance(a, FakeTensor) else a
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                vals = [real(t) for t in a]
                return None if any(v is None for v in vals) else vals
            return a

        vals = [real(a) for a in args]
        if any(v is None for v in vals):
            return
        with unset_fake_temporarily():
            r = func(*vals, **{k: v for k, v in kwargs.items() if k != "device"})
        for o, v in zip(out, r) if isinstance(out, (list, tuple)) else [(out, r)]:
            self.value[o] = v


def _grouped_mm_shape(a: torch.Size, b: torch.Size, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output shape of torch._grouped_mm(a, b, offs): 2d x 3d -> [M, N]; 2d x 2d (groups along K) -> [G, M, N];
    3d x 2d -> [M, N]; 3d x 3d -> [G, M, N]."""
    if len(a) == 2 and len(b) == 2:
        return (offs.shape[0], a[0], b[1])
    if len(a) == 3 and len(b) == 3:
        return (a[0], a[1], b[2])
    return (a[-2], b[-1])


class FlexSaved(torch.autograd.Function):
    """Stand-in for the fused flex-attention kernel under fake tensors: keeps what its autograd keeps (q, k, v, the
    output and the fp32 logsumexp [B, H, Q]), computes nothing, and returns gradients shaped like the inputs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class RMSNormSaved(torch.autograd.Function):
    """Stand-in for CUDA's fused RMSNorm under fake tensors: keeps the input, the fp32 rstd and the weight."""

    @staticmethod
    def forward(ctx, x, weight, dims):
        rstd = x.new_empty(x.shape[:-dims] + (1,) * dims, dtype=torch.float32)
        ctx.has_weight = weight is not None
        ctx.save_for_backward(x, rstd, *([weight] if weight is not None else []))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, _, *w = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(w[0]) if ctx.has_weight else None), None


def _rms_norm_saved(x, normalized_shape, weight=None, eps=None):
    return RMSNormSaved.apply(x, weight, len(normalized_shape))


def synthetic_batch(cfg: RunConfig) -> BlockBatch:
    """A packed batch at the preset's shape: samples_per_batch sequences of max_len tokens, each with an untrained
    prompt of max_len/16 tokens (at most 256), anchors_per_seq anchors; features of width 1 (the trainer replaces
    them with [T, D] ones)."""
    S, L = cfg.data.samples_per_batch, cfg.data.max_len
    T = S * L
    mask = np.ones(T, bool)
    prompt = min(256, L // 16)
    for s in range(S):
        mask[s * L: s * L + prompt] = False
    fb = FeatureBatch(0, tuple(range(S)), torch.zeros(T, dtype=torch.long), torch.from_numpy(mask),
                      torch.arange(0, T + 1, L, dtype=torch.long), torch.zeros(T, 1, dtype=torch.bfloat16),
                      torch.zeros(T, 1, dtype=torch.bfloat16))
    bb, _ = pack([fb], cfg.draft.block_size, cfg.data.anchors_per_seq, cfg.data.seed)
    return bb


def _init_fake_group(world: int) -> bool:
    if dist.is_initialized() or world < 2:
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=world)
    return True


def trainer_memory(cfg: RunConfig, hidden: int, vocab: int, *, fake: bool = True, cuda_form: bool = True,
                   dtype: torch.dtype = torch.bfloat16) -> TrainerMemory:
    """One trainer rank's peak over a micro-batch's forward+backward (see the module docstring). cuda_form=False
    runs the model as it runs on a CPU (the config's attention kernel, no stand-ins); fake=False runs that on real
    CPU tensors (random weights): what the test checks the fake estimate against, at a small shape."""
    if cuda_form and not fake:
        raise ValueError("the CUDA form (flex attention, fused RMSNorm) runs on fake tensors only on a CPU")
    import draft_model.attention as attention
    import draft_model.loss as loss_mod
    from draft_model.registry import build_draft
    from workers.trainer.step import DraftWithLoss, as_loss_parts, checkpoint_layers, setup_moe_balance

    if cuda_form and cfg.loss.matmul_dtype == "auto":  # what `auto` resolves to on an H100/H200: native bf16
        cfg = replace(cfg, loss=replace(cfg.loss, matmul_dtype="bfloat16"))
    bb = synthetic_batch(cfg)
    ctx_is_final = list(cfg.draft.target_layers) == [FINAL_HIDDEN]
    T = bb.input_ids_T.shape[0]
    # a rank holds its step's grad_accum micro-batches and the prefetched next step's (workers/trainer/prefetch.py):
    # the run below tracks one; the others' features are [T, D] each (twice when the context is not the final state)
    queued = (2 * cfg.train.grad_accum - 1) * T * hidden * dtype.itemsize * (1 if ctx_is_final else 2)
    draft_cfg = replace(cfg.draft, vocab_size=vocab, hidden_size=hidden,
                        attn_impl="flex" if cuda_form else cfg.draft.attn_impl)
    valid_rows = int(bb.valid_NK.sum())
    patched = [(attention, "flex_kernel", attention.flex_kernel), (loss_mod, "CACHE_BYTES", loss_mod.CACHE_BYTES),
               (F, "rms_norm", F.rms_norm)]
    group = _init_fake_group(cfg.cluster.num_trainers)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    try:
        if cuda_form:
            attention.flex_kernel = lambda device: (lambda q, k, v, block_mask, enable_gqa: FlexSaved.apply(q, k, v))
            loss_mod.CACHE_BYTES = 1 << 62  # CUDA's form: the elementwise chain over the whole chunk
            F.rms_norm = _rms_norm_saved
        with fake_mode or _nullcontext(), (Hints(fake_mode, valid_rows) if fake else _nullcontext()) as hints:
            module = _build(build_draft, DraftWithLoss, draft_cfg, cfg, vocab, hidden, dtype, fake)
            setup_moe_balance(module.draft)
            if cfg.train.activation_checkpointing:
                checkpoint_layers(module.draft)
            saved: dict[int, tuple[str, int]] = {}

            def keep(t: torch.Tensor) -> torch.Tensor:
                st = t.untyped_storage()
                saved[id(st)] = (f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}", st.nbytes())
                return t

            tracker = MemTracker()
            tracker.track_external(module)
            with tracker:
                batch = _device_batch(bb, hidden, dtype, hints, ctx_is_final)
                with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                    parts = as_loss_parts(module(batch), cfg.loss)
                loss = parts.total(parts.weight_sum) + parts.aux_loss
                loss.backward()
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        for obj, name, value in patched:
            setattr(obj, name, value)
        if group:
            dist.destroy_process_group()
    kinds = {str(k.value) if hasattr(k, "value") else str(k): v for k, v in snap.items()}
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    world = max(cfg.cluster.num_trainers, 1)
    return TrainerMemory(params=kinds.get("Parameter", 0) + kinds.get("Buffer", 0), grads=kinds.get("Gradient", 0),
                         activations=kinds.get("Activation", 0) + kinds.get("Temp", 0) + kinds.get("Other", 0),
                         optimizer=ZERO_STATE_BYTES * trainable // world,
                         bucket=min(trainable, REDUCE_BUCKET_ELEMS) * dtype.itemsize if world > 1 else 0,
                         tracked_peak=kinds["Total"], trainable=trainable,
                         saved=sorted(saved.values(), key=lambda x: (-x[1], x[0])), queued=queued)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _build(build_draft, wrapper, draft_cfg, cfg, vocab, hidden, dtype, fake):
    """The trainer's module: parameters in the training dtype, buffers as the model stores them (DeepSpeed's bf16
    mode casts parameters, not buffers; the frozen embedding and head are built in workers/trainer/precision's
    frozen_dtype). Fake: built on the meta device, then given fake tensors."""
    from workers.trainer.precision import frozen_dtype

    stored = frozen_dtype(cfg)  # the frozen embedding and head, as the Ray trainer stores them
    if not fake:
        torch.manual_seed(0)
        embed = torch.randn(vocab, hidden) * 0.02
        module = wrapper(build_draft(draft_cfg, embed, torch.randn(vocab, hidden) * 0.02, frozen_dtype=stored),
                         cfg.loss)
        for p in module.parameters():
            p.data = p.data.to(dtype)
        return module
    with torch.device("meta"):
        module = wrapper(build_draft(draft_cfg, torch.empty(vocab, hidden), torch.empty(vocab, hidden),
                                     frozen_dtype=stored), cfg.loss)
    for m in module.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), p.requires_grad)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = torch.empty(b.shape, dtype=b.dtype)
    return module


def _device_batch(bb: BlockBatch, hidden: int, dtype: torch.dtype, hints: Hints | None,
                  ctx_is_final: bool) -> BlockBatch:
    """The packed batch as the trainer holds it: [T, D] context features and final hidden states in the training
    dtype, one tensor when the draft reads the final layer only (as pack aliases them), index tensors as packed.
    Fake: built field by field (BlockBatch's own checks ran when the packer built it; under fake tensors they
    would read values)."""
    T = bb.input_ids_T.shape[0]
    make = torch.randn if hints is None else torch.empty
    final_TD = make(T, hidden, dtype=dtype)
    ctx_TF = final_TD if ctx_is_final else make(T, hidden, dtype=dtype)
    if hints is None:
        return replace(bb, ctx_feats_TF=ctx_TF, final_hidden_TD=final_TD)
    values = {f.name: getattr(bb, f.name) for f in fields(bb)}
    values = {k: hints.fake(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
    values["ctx_feats_TF"] = ctx_TF
    values["final_hidden_TD"] = final_TD
    batch = object.__new__(BlockBatch)
    for k, v in values.items():
        object.__setattr__(batch, k, v)
    return batch


# How the published DeepSeek-V4 checkpoints store their weights (module docstring): FP8 blocks of 128 x 128 with a
# scale each, routed experts in FP4; workers/frozen_target/sizing.py counts a config so marked in those bytes.
V4_STORED = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}, "expert_dtype": "fp4"}


def v4_model_config(preset: str):
    """The target's transformers config for a production preset (sources in the module docstring), marked with the
    checkpoint's stored precision."""
    config = _v4_architecture(preset)
    for key, value in V4_STORED.items():
        setattr(config, key, value)
    return config


def _v4_architecture(preset: str):
    from transformers import DeepseekV4Config

    if preset == "v4-flash":
        return DeepseekV4Config()
    layers = 61
    return DeepseekV4Config(
        hidden_size=7168, num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=1, head_dim=512,
        q_lora_rank=1536, o_lora_rank=1024, o_groups=16, n_routed_experts=384, num_experts_per_tok=6,
        n_shared_experts=1, moe_intermediate_size=3072, vocab_size=129280,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (layers - 3),
        layer_types=["heavily_compressed_attention"] * 2 + [
            "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
            for i in range(2, layers)])


def target_fields(cfg: RunConfig, preset: str, gpu_gib: float):
    """(weights_gib, capture_gib, fits, largest forward) of one target rank, from workers.frozen_target.sizing."""
    from workers.frozen_target.sizing import target_memory

    tm = target_memory(cfg, gpu_gib, v4_model_config(preset))
    return tm.weights_gib, tm.capture_gib, bool(tm.fits), tm.max_tokens_per_forward


def memory_line(preset: str, trainer_peak_gib: float, target: tuple | None, gpu_gib: float,
                fits: bool) -> str:
    w, c = ("na", "na") if target is None else (f"{target[0]:.1f}", f"{target[1]:.1f}")
    return (f"memory preset={preset} trainer_peak_gib={trainer_peak_gib:.1f} target_weights_gib={w} "
            f"target_capture_gib={c} gpu_gib={gpu_gib:g} fits={'yes' if fits else 'no'}")


def describe(tm: TrainerMemory) -> list[str]:
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    out = [f"  trainable parameters {tm.trainable / 1e9:.3f} B; at the forward+backward peak: params+buffers "
           f"{g(tm.params)} GiB, grads {g(tm.grads)} GiB, activations+temporaries {g(tm.activations)} GiB "
           f"(tracked {g(tm.tracked_peak)} GiB); ZeRO optimizer state {g(tm.optimizer)} GiB; reduce bucket "
           f"{g(tm.bucket)} GiB; queued feature batches {g(tm.queued)} GiB; peak {g(tm.peak)} GiB",
           "  largest tensors autograd keeps:"]
    out += [f"    {what}: {g(n)} GiB" for what, n in tm.saved[:8]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESET_GPU), action="append")
    ap.add_argument("--gpu-gib", type=float, help="GPU memory to size for (default: the preset's GPU, PRESET_GPU)")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every preset (key=value)")
    args = ap.parse_intermixed_args(argv)  # flags and dotted overrides in any order
    lines = []
    for preset in args.preset or sorted(PRESET_GPU):
        cfg = load_config(ROOT / "launch" / "configs" / f"{preset}.yaml", args.overrides)
        gpu, gpu_gib = PRESET_GPU[preset] if args.gpu_gib is None else (f"{args.gpu_gib:g} GiB", args.gpu_gib)
        hidden = v4_model_config(preset).hidden_size
        t0 = time.perf_counter()
        tm = trainer_memory(cfg, hidden, 129280)
        print(f"{preset} trainer ({cfg.data.samples_per_batch} x {cfg.data.max_len} tokens, "
              f"{cfg.data.anchors_per_seq} anchors, hidden {hidden}, {cfg.cluster.num_trainers} ranks, activation "
              f"checkpointing {cfg.train.activation_checkpointing}) on {gpu}: estimated in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        for line in describe(tm):
            print(line, flush=True)
        target = target_fields(cfg, preset, gpu_gib)
        t = cfg.target
        above = (f"KV cache ({t.vllm_kv_cache_gib:g} GiB) + prefill" if t.backend == "vllm" else "capture")
        print(f"  target rank ({t.backend}, tp {t.tp_size} x pp {t.pp_size}): weights "
              f"{target[0]:.1f} GiB as stored, {above} {target[1]:.1f} GiB at "
              f"target.max_tokens_per_forward={t.max_tokens_per_forward} (at most {target[3]} fit)", flush=True)
        fits = tm.peak / GIB <= gpu_gib and target[2]
        lines.append(memory_line(preset, tm.peak / GIB, target, gpu_gib, fits))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
