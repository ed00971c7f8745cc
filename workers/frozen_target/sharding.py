"""How a frozen target is sharded over a target group: the transformers `DistributedConfig` for tensor (and expert)
parallelism, and the checks, made from the target's config.json alone, that the group shape fits the model.

The sharding itself is transformers' own (`from_pretrained(..., distributed_config=...)`, transformers 5.24): the
model config's `base_model_tp_plan` splits attention heads, expert and MLP widths and the vocabulary over the
group; with expert parallelism its `base_model_ep_plan` instead gives each rank whole experts (num_experts /
tp_size of them) while the dense modules stay tensor-parallel. Qwen3-MoE, DeepSeek-V3, Mixtral and about 70 other
architectures ship both plans; a model without a plan is refused here with one line, before any worker starts.
"""

from __future__ import annotations

from typing import Any

# Config attributes that give the number of routed experts, in the spellings architectures use.
_EXPERT_COUNTS = ("num_local_experts", "n_routed_experts", "num_experts")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rules(plan: dict[str, str] | None, *fragments: str) -> bool:
    return any(any(f in key for f in fragments) for key in (plan or {}))


def sharding_problem(config: Any, tp_size: int, expert_parallel: bool) -> str | None:
    """Why a target with this (transformers) config cannot be split over `tp_size` ranks, or None if it can."""
    if tp_size == 1:
        return None
    cfg = _text_config(config)
    kind = getattr(cfg, "model_type", type(cfg).__name__)
    tp_plan = getattr(cfg, "base_model_tp_plan", None)
    ep_plan = getattr(cfg, "base_model_ep_plan", None)
    if not tp_plan:
        return (f"target.tp_size={tp_size}: the target ({kind}) has no tensor-parallel plan in transformers "
                "(config.base_model_tp_plan); use target.tp_size=1 (target.device_map=auto spreads it over one node)")
    if expert_parallel and not ep_plan:
        return (f"target.expert_parallel=true: the target ({kind}) has no expert-parallel plan in transformers "
                "(config.base_model_ep_plan); set target.expert_parallel=false to split its experts by tensor "
                "parallelism instead")
    # The widths each rule splits evenly over the group, as the plans in use name them.
    need: list[tuple[str, str]] = []
    if _rules(tp_plan, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        need += [("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads")]
    if expert_parallel:
        expert_attr = next((a for a in _EXPERT_COUNTS if getattr(cfg, a, None)), None)
        if expert_attr is not None:
            need.append((expert_attr, "experts (expert parallelism gives each rank whole experts)"))
    elif _rules(tp_plan, "experts.gate_up_proj", "experts.down_proj"):
        need.append(("moe_intermediate_size", "expert intermediate width"))
    if _rules(tp_plan, "mlp.gate_proj", "mlp.up_proj", "shared_experts"):
        need.append(("intermediate_size", "dense MLP width"))
    for attr, what in need:
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value % tp_size:
            return (f"target.tp_size={tp_size} does not divide the target's {attr} ({value}): the {kind} plan splits "
                    f"its {what} evenly over the group; use a tp_size that divides {value}")
    return None


def check_sharding(config: Any, tp_size: int, expert_parallel: bool) -> None:
    """ValueError (one line) when the target cannot be split as asked."""
    problem = sharding_problem(config, tp_size, expert_parallel)
    if problem:
        raise ValueError(problem)


def distributed_config(tp_size: int, expert_parallel: bool) -> Any:
    """The transformers DistributedConfig of one group member. EP is spelled `ep_size` since transformers 5.21
    (`enable_expert_parallel` alone now means "experts only, no dense TP"): ep_size = tp_size keeps attention and
    dense layers tensor-parallel and gives each rank whole experts; at inference, where every rank of the group sees
    the same batch, transformers runs the experts' "all_reduce" dispatch (each rank its experts, outputs summed)."""
    from transformers.distributed import DistributedConfig

    if expert_parallel:
        return DistributedConfig(tp_size=tp_size, ep_size=tp_size)
    return DistributedConfig(tp_size=tp_size)
