"""Which target hidden states an engine hands a served draft, against the ones it trained on (docs/vllm-target.md,
"Layer ids"), and the error every export raises when a draft cannot be written faithfully. Its own module so that
both engine exports (serving/engine_export.py) and DeepSeek's checkpoint layout (serving/deepseek_checkpoint.py)
use one rule without importing each other.
"""

from __future__ import annotations

from draft_model.config import DraftConfig


class NotServable(ValueError):
    """The draft cannot be written in the asked format faithfully; the message says why and what can."""


def check_target_layers(cfg: DraftConfig, num_layers: int, hc_mult: int = 1) -> None:
    """NotServable when a context layer the draft trained on is not what an engine hands it for that index: our L
    is the target's final state after its norm (and, on DeepSeek-V4, after hc_head), while vLLM's aux id L (written
    as L - 1) is the last layer's output before them; a hyper-connection target (DeepSeek-V4) in vLLM taps decoder-
    layer outputs only, so our 0 (the embeddings) has no aux id there (docs/vllm-target.md, "Layer ids"). The final
    state as -1 is refused before this: by check_servable for the engine formats, by the dsv4 draft config itself
    for DeepSeek's layout."""
    if num_layers in cfg.target_layers:
        raise NotServable(f"draft.target_layers holds {num_layers} (= num_hidden_layers), the target's final state "
                          "after its norm, which engines never hand a draft (vLLM's aux id L is the last layer's "
                          f"output before it); train on layers 1..{num_layers - 1}")
    if hc_mult > 1 and 0 in cfg.target_layers:
        raise NotServable("draft.target_layers holds 0 (the embeddings) for a DeepSeek-V4 target, whose vLLM model "
                          "captures decoder-layer outputs only (aux ids 1..L); train on layers "
                          f"1..{num_layers - 1}")
