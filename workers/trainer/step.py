"""One optimizer step of draft training, shared by the Ray Train + DeepSpeed trainers (workers/trainer/ray_trainer.py)
and the single-process trainer (workers/trainer/single_process.py). Nothing here imports Ray or DeepSpeed: `engine` is
anything with DeepSpeed's engine interface (`engine(batch)`, `engine.backward(loss)`, `engine.step()`, stepping the
optimizer at the gradient-accumulation boundary).

Loss scaling: the engine divides the loss by grad_accum and averages gradients over R ranks; we want the gradient
of Σ_all numerators / Σ_all weights + mean_all aux, so each micro-batch's loss is
numerator / global_weight_sum · R · grad_accum + aux (the MoE balance loss is already a per-micro-batch mean).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from draft_model.batch import BlockBatch
from draft_model.config import LossConfig
from draft_model.loss import LossParts, expected_tau, output_loss, position_weights
from pipeline.config import RunConfig
from pipeline.contracts import FeatureBatch, decode_features, nonfinite_message
from pipeline.order import batches_per_epoch
from pipeline.packing import PackStats, pack
from workers.trainer.collective import collective_device


class DraftWithLoss(nn.Module):
    """The draft and its loss in one module, so that ZeRO-3 has every parameter gathered while the loss runs.

    forward returns the LossParts tensors as a plain tuple (`as_loss_parts` rebuilds the dataclass). ZeRO-3
    attaches its pre-backward hook, which re-gathers this module's parameters and its external ones (the
    sequential head's W2, read here outside any submodule's forward), only to tensors it finds in a module's
    output, and it does not look inside a dataclass: with LossParts returned, W2 stayed partitioned (size 0)
    when the vocabulary loss's backward and W2's gradient hook ran, and the first backward failed with
    "The size of tensor a (0) must match the size of tensor b (V)". (The loss's autograd Function saves W2
    itself, not a copy, so its backward reads whatever ZeRO has gathered by then: the hook makes that all of it.)
    """

    def __init__(self, draft: nn.Module, loss_cfg: LossConfig) -> None:
        super().__init__()
        self.draft = draft
        self.loss_cfg = loss_cfg

    def forward(self, batch: BlockBatch) -> tuple[torch.Tensor, ...]:
        out = self.draft(batch)
        target_hidden_NKD = batch.final_hidden_TD[batch.target_index_NK()]
        parts = output_loss(out, self.draft.lm_head_weight(), self.draft.head_w2(), batch.labels_NK(),
                            target_hidden_NKD, batch.valid_NK, self.loss_cfg,
                            num_valid=int(batch.host_index().valid_len_N.sum()))  # host copy: no sync
        return tuple(getattr(parts, name) for name in _PART_TENSORS)


_PART_TENSORS = ("ce_sum", "tv_sum", "conf_sum", "aux_loss", "weight_sum", "c_star_NK")


def as_loss_parts(outputs: tuple[torch.Tensor, ...], loss_cfg: LossConfig) -> LossParts:
    """The LossParts of a `DraftWithLoss` forward (any engine wrapping it returns its tuple unchanged)."""
    return LossParts(**dict(zip(_PART_TENSORS, outputs, strict=True)), ce_weight=loss_cfg.ce_weight,
                     tv_weight=loss_cfg.tv_weight, conf_weight=loss_cfg.conf_weight)


def decoder_layers(draft: nn.Module, key: str) -> nn.ModuleList:
    """The draft backbone's decoder layers, which `key` (a train.* switch) applies to."""
    layers = getattr(getattr(draft, "backbone", draft), "layers", None)  # dsv4 holds its stages itself
    if layers is None:
        raise ValueError(f"{key}: {type(draft).__name__} has no backbone layers to apply it to")
    return layers


def compile_draft(draft: nn.Module) -> int:
    """torch.compile every decoder layer of the draft backbone in place (dynamic shapes: T and N change every
    batch); returns how many. Applied here, never inside draft_model/. The first steps pay the compile (minutes on
    a small CPU); on a 2-core CPU it measured no faster than eager (docs/design-notes.md), so it is off by default."""
    layers = decoder_layers(draft, "train.compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def checkpoint_layers(draft: nn.Module) -> int:
    """Activation checkpointing per decoder layer (train.activation_checkpointing), applied from outside the model
    as torchtitan's apply_ac does: each layer keeps only its inputs for the backward and runs its forward again
    there (torch.utils.checkpoint, non-reentrant). Returns how many layers. Apply it before compile_draft.

    A recomputed forward must not change module state twice: the MoE adds each forward's expert load to the
    step's balance update (moe.py says recomputation would count it twice). So the recompute runs with the layer's
    buffers and plain tensor attributes saved before and restored after it; the first forward's effects stand.
    The draft's own forward holds no collective: the MoE's load all-reduce runs once per step, in
    apply_moe_balance, after the last backward."""
    from torch.utils.checkpoint import checkpoint

    def state(layer: nn.Module) -> list[tuple[nn.Module, dict[str, Any], dict[str, torch.Tensor]]]:
        return [(m, {k: v for k, v in vars(m).items() if v is None or isinstance(v, torch.Tensor)},
                 {k: b.clone() for k, b in m._buffers.items() if b is not None}) for m in layer.modules()]

    def restore(saved: list[tuple[nn.Module, dict[str, Any], dict[str, torch.Tensor]]]) -> None:
        with torch.no_grad():
            for m, attrs, bufs in saved:
                for k, v in attrs.items():
                    object.__setattr__(m, k, v)
                for k, b in bufs.items():
                    m._buffers[k].copy_(b)

    def wrap(layer: nn.Module) -> Any:
        forward = layer.forward

        def checkpointed(*args: Any) -> Any:
            calls = []

            def run(*a: Any) -> Any:
                if not calls:  # the forward itself
                    calls.append(1)
                    return forward(*a)
                saved = state(layer)  # the recompute in the backward
                try:
                    return forward(*a)
                finally:
                    restore(saved)

            return checkpoint(run, *args, use_reentrant=False)

        return checkpointed

    layers = decoder_layers(draft, "train.activation_checkpointing")
    for layer in layers:
        layer.forward = wrap(layer)
    return len(layers)


def prepare_draft(draft: nn.Module, cfg: RunConfig) -> nn.Module:
    """What every trainer applies to a freshly built draft, in this order: the once-per-step MoE balance, then
    activation checkpointing (train.activation_checkpointing), then compile (train.compile), which must wrap the
    checkpointed layers. Returns the draft."""
    setup_moe_balance(draft)
    if cfg.train.activation_checkpointing:
        checkpoint_layers(draft)
    if cfg.train.compile:
        compile_draft(draft)
    return draft


def setup_moe_balance(draft: nn.Module) -> None:
    """Every trainer's MoE balance bias: updated once per optimizer step from the load of the whole global batch
    (`optimizer_step` applies it through `apply_moe_balance`), the same on every data-parallel replica."""
    from draft_model.moe import MoE

    for m in draft.modules():
        if isinstance(m, MoE):
            m.defer_bias_update()


def apply_moe_balance(module: nn.Module) -> None:
    """Move every MoE's balance bias from its load over the step, summed over the data-parallel replicas by one
    all-reduce of all layers' loads together (on their device, so a NCCL group takes it), not one per forward."""
    from draft_model.moe import MoE

    moes = [m for m in module.modules() if isinstance(m, MoE) and m.pending_load_E is not None]
    if not moes:
        return
    loads = [m.pending_load_E for m in moes]
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat(loads)
        dist.all_reduce(flat)
        loads = list(flat.split([t.numel() for t in loads]))
    for m, load_E in zip(moes, loads, strict=True):
        m.apply_bias_update(load_E)


def all_reduce_sum(values: list[float]) -> list[float]:
    """Σ over the ranks in fp64, on the device the group's backend serves (workers/trainer/collective.py)."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


class MicroBatch(NamedTuple):
    """One micro-batch of a rank's optimizer step, ready to train."""

    batch: BlockBatch  # packed, on the device
    stats: PackStats
    wire_bytes: int  # what its FeatureBatch took on the wire
    batch_index: int = -1  # the global feature batch it was packed from
    sample_ids: tuple[int, ...] = ()  # the samples that FeatureBatch carried (for the sample ledger)
    features_finite: torch.Tensor | None = None  # 0-d bool on the device (decode_features); read with the step's sums


def pack_micro_batch(fb: FeatureBatch, batch_index: int, cfg: RunConfig, num_samples: int, dtype: torch.dtype,
                     device: torch.device) -> MicroBatch:
    """The wire feature batch consumed as global batch `batch_index` -> its MicroBatch on `device`. Anchors are a
    pure function of (seed, epoch, sample id), so they change per epoch but never per rank or trainer kind. (With
    data.replay_batches, fb is a replayed batch: the epoch is still `batch_index`'s.)

    Packed on the host in the wire dtype (no feature copy when every row is kept), moved with pinned, non-blocking
    copies (the final state crosses once when it is also the context), then decoded on the device; the finite
    check's flag rides along unread until `optimizer_step` reads the step's sums."""
    wire_bytes = fb.nbytes()
    epoch = batch_index // batches_per_epoch(num_samples, cfg.data.samples_per_batch)
    bb, stats = pack([fb], cfg.draft.block_size, cfg.data.anchors_per_seq, cfg.data.seed + epoch,
                     full_blocks_first=cfg.data.full_blocks_first)
    bb = bb.to(device, non_blocking=True)
    ctx, fin, finite = decode_features(bb.ctx_feats_TF, bb.final_hidden_TD, dtype)
    bb = replace(bb, ctx_feats_TF=ctx, final_hidden_TD=fin)
    return MicroBatch(bb, stats, wire_bytes, batch_index, tuple(fb.sample_ids), finite)


def optimizer_step(engine: Any, micro: list[MicroBatch], decay_lambda: float,
                   world: int) -> tuple[dict[str, float], float]:
    """One optimizer step over this rank's micro-batches (DeepSpeed steps the optimizer after the last one).

    The denominator Σw over every rank's micro-batches is known before any forward (it depends only on the
    valid masks); each micro-batch's loss is scaled by world·grad_accum/Σw, undoing DeepSpeed's averaging, so the
    update is the gradient of (Σ numerators)/(Σ w) over the global batch. Returns this rank's metric sums and Σw.
    """
    lengths = [mb.batch.host_index().valid_len_N for mb in micro]  # host copies: no device sync for Σw
    local_w = sum(host_weight_sum(n_N, mb.batch.block_size, decay_lambda) for n_N, mb in zip(lengths, micro))
    (global_w,) = all_reduce_sum([local_w])
    scale = world * len(micro)
    loss_cfg = engine.module.loss_cfg
    counts = dict.fromkeys(("trained", "wire", "useful", "computed", "blocks"), 0.0)  # tokens, bytes, blocks
    # wall seconds of this rank's phases (forward with the loss, backward with its gradient reduction, the
    # optimizer); host clocks: on a GPU they time what the host waited for, not the kernels
    phases = dict.fromkeys(("t_forward", "t_backward", "t_optimizer"), 0.0)
    # ce, tv, conf, aux, tau_sum and the micro-batches with non-finite features, summed on the device: one transfer
    # per step, not six per micro-batch
    device_sums = None
    for (bb, stats, wire_bytes, _, _, finite), n_N in zip(micro, lengths):
        t0 = time.perf_counter()
        parts = as_loss_parts(engine(bb), loss_cfg)
        # only the normalised term is rescaled: the engine's average over world·grad_accum micro-batches then
        # leaves Σ numerators / Σ w plus the *mean* MoE aux loss, which is what step_metrics logs
        weighted = replace(parts, aux_loss=torch.zeros_like(parts.aux_loss))
        loss = weighted.total(torch.tensor(global_w, dtype=parts.ce_sum.dtype)) * scale + parts.aux_loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        phases["t_forward"] += t1 - t0
        phases["t_backward"] += t2 - t1
        phases["t_optimizer"] += t3 - t2
        blocks = int((n_N > 0).sum())
        tau_sum = expected_tau(parts.c_star_NK, bb.valid_NK) * blocks if blocks else parts.ce_sum.new_zeros(())
        bad = parts.ce_sum.new_zeros(()) if finite is None else (~finite).to(parts.ce_sum.device)
        sums = torch.stack([t.detach().to(torch.float64) for t in (parts.ce_sum, parts.tv_sum, parts.conf_sum,
                                                                     parts.aux_loss, tau_sum, bad)])
        device_sums = sums if device_sums is None else device_sums + sums
        for key, value in (("trained", int(n_N.sum())), ("wire", wire_bytes), ("useful", stats.useful_block_tokens),
                           ("computed", stats.computed_block_tokens), ("blocks", blocks)):
            counts[key] += value
    apply_moe_balance(engine.module)  # once per optimizer step, from the whole global batch's load
    ce, tv, conf, aux, tau, bad = device_sums.tolist() if device_sums is not None else [0.0] * 6
    # `bad` is not raised here: it rides on the loop's metric all-reduce, so every rank stops (check_features)
    return {"ce": ce, "tv": tv, "conf": conf, "aux": aux, "trained": counts["trained"], "wire": counts["wire"],
            "useful": counts["useful"], "computed": counts["computed"], "tau_sum": tau,
            "blocks": counts["blocks"], **phases, "bad_features": bad}, global_w


def check_features(bad_features: float, micro: list[MicroBatch], step: int) -> None:
    """Raise on every rank when any rank's micro-batches had non-finite features (`bad_features`: their count
    summed over the ranks by the step's metric all-reduce), before the loss is judged or anything is saved: the
    features, not the draft, went wrong. A rank that raised alone would leave the others waiting in the next
    collective until its timeout. The rank holding such a batch names it and its token rows."""
    if bad_features <= 0:
        return
    for mb in micro:
        if mb.features_finite is not None and not bool(mb.features_finite):
            raise ValueError(nonfinite_message(mb.batch.ctx_feats_TF, mb.batch.final_hidden_TD, mb.batch_index,
                                               mb.sample_ids))
    raise ValueError(f"non-finite target features in {int(bad_features)} micro-batch(es) of step {step} on another "
                     "trainer rank (its error names the batch and token rows): the target produced NaN/Inf")


def host_weight_sum(valid_len_N: np.ndarray, block_size: int, decay_lambda: float) -> float:
    """Σ of `position_weights` over blocks with these valid-prefix lengths, on the host (fp64): the weights are
    the loss's own, so the step's denominator is the sum of what the loss weighs."""
    w_K = position_weights(torch.ones(block_size, dtype=torch.bool), decay_lambda, dtype=torch.float64).numpy()
    cum_K1 = np.concatenate([[0.0], np.cumsum(w_K)])
    return float(cum_K1[valid_len_N].sum())


def param_groups(module: nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """Trainable parameters as optimizer groups: the sequential head's low-rank table (W1, W2) at
    lr · train.head_lr_scale, everything else at lr. W2 starts at zero, so the head's bias W1[x]·W2 grows from
    nothing at a rate set by this scale. The RNN head's gate, candidate and output layers are ordinary dense
    layers initialised like the backbone's, so they stay in the backbone group. Schedulers scale each group's
    own lr."""
    draft = module.draft if isinstance(module, DraftWithLoss) else module
    head = getattr(draft, "head", None)
    head_ids = {id(head.w1.weight), id(head.w2_RV)} if head is not None else set()
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if id(p) not in head_ids], "lr": cfg.train.lr, "name": "backbone"}]
    head_params = [p for p in trainable if id(p) in head_ids]
    if head_params:
        groups.append({"params": head_params, "lr": cfg.train.lr * cfg.train.head_lr_scale, "name": "head"})
    return [g for g in groups if g["params"]]


def step_metrics(totals: list[float], global_w: float, cfg: RunConfig, world: int, dt: float, t_data: float,
                 lr: float, step: int) -> dict[str, float]:
    """The logged metrics of one step from the all-reduced sums of `optimizer_step` (`check_features` has judged the
    last one, the count of batches with non-finite features); stops on a non-finite loss."""
    ce, tv, conf, aux, trained, wire, useful, computed, tau_sum, blocks, t_fwd, t_bwd, t_opt, _ = totals
    for name, value in (("ce", ce), ("tv", tv), ("conf", conf)):
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step}: the {name} loss is {value}; stopping before any "
                                     "checkpoint is written (check the learning rate and the target features)")
    return {
        "loss": (cfg.loss.ce_weight * ce + cfg.loss.tv_weight * tv + cfg.loss.conf_weight * conf) / global_w
        + aux / (world * cfg.train.grad_accum),
        "loss_ce": ce / global_w, "loss_tv": tv / global_w, "loss_conf": conf / global_w, "lr": lr,
        "tokens_per_s": trained / dt, "bytes_per_token": wire / max(trained, 1.0),
        "packing_density": useful / max(computed, 1.0), "tau_est": tau_sum / max(blocks, 1.0),
        "trained_tokens": trained, "step_time_s": dt, "data_wait_s": t_data,
        # summed over the ranks: trainer-seconds of each phase in this step (rank 0's data wait is data_wait_s)
        "forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt,
    }


def format_step(step: int, max_steps: int, m: dict[str, float], eta_s: float) -> str:
    return (f"step {step}/{max_steps} | loss {m['loss']:.4f} (ce {m['loss_ce']:.3f} tv {m['loss_tv']:.3f} "
            f"conf {m['loss_conf']:.3f}) | lr {m['lr']:.2e} | tok/s {m['tokens_per_s']:.0f} | "
            f"B/tok {m['bytes_per_token']:.0f} | density {m['packing_density']:.3f} | tau {m['tau_est']:.3f} | "
            f"dt {m['step_time_s']:.2f}s | eta {eta_s:.0f}s")
