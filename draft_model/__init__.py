"""DSpark draft models (pure PyTorch): config, packed block batch, model, heads, registry and presets.

Importing the package registers the built-in architectures (draft_model/registry.py): dspark (model.py), eagle3
(eagle3.py; the mtp1 preset builds it too) and draft-lm (draft_lm.py). A new architecture adds its import here.
"""

import draft_model.draft_lm  # noqa: F401  (registers "draft-lm")
import draft_model.dsv4  # noqa: F401  (registers "dsv4")
import draft_model.eagle3  # noqa: F401  (registers "eagle3")
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig, LossConfig, MoEConfig
from draft_model.model import DraftModel, DraftOutput
from draft_model.presets import draft_preset
from draft_model.registry import DRAFTS, build_draft, register_draft

__all__ = ["BlockBatch", "DraftConfig", "LossConfig", "MoEConfig", "DraftModel", "DraftOutput", "draft_preset",
           "DRAFTS", "build_draft", "register_draft"]
