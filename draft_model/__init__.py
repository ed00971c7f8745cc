"""DSpark draft models (pure PyTorch): config, packed block batch, model, heads, registry and presets."""

from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig, LossConfig, MoEConfig
from draft_model.model import DraftModel, DraftOutput
from draft_model.presets import draft_preset
from draft_model.registry import DRAFTS, build_draft, register_draft

__all__ = ["BlockBatch", "DraftConfig", "LossConfig", "MoEConfig", "DraftModel", "DraftOutput", "draft_preset",
           "DRAFTS", "build_draft", "register_draft"]
