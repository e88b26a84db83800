"""hf-blockpilot: block-diffusion (DFlash) speculative decoding for Transformers, with per-request block sizes.

    import hf_blockpilot
    drafter = hf_blockpilot.BlockDiffusionDrafter.from_pretrained("z-lab/Qwen3-4B-DFlash-b16")
    target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
    target.generate(**inputs, assistant_model=drafter, draft_controller=hf_blockpilot.AdaptiveVerify(16))
    target.generate(**inputs, custom_generate=hf_blockpilot.generate, drafter=drafter)  # nothing patched
    drafter.last_stats.tau

Importing the package registers the drafter with `AutoConfig`/`AutoModel` and routes
`generate(assistant_model=<BlockDiffusionDrafter>)` to `custom_generate=hf_blockpilot.generate` (one wrapper of the
public `generate`; `hf_blockpilot.routing` says how to opt out).
"""

import importlib
import warnings
from typing import Any

from transformers import AutoConfig, AutoModel

from .configuration_block_diffusion import BlockDiffusionConfig
from .controllers import (
    AcceptanceEMA,
    AdaptiveVerify,
    BlockSizePolicy,
    DraftController,
    EntropyStop,
    HeuristicSchedule,
    PolicyBlockSize,
    SpeculationGuard,
    default_controller,
)
from .costs import CostModel
from .custom_generate import generate
from .modeling_block_diffusion import BlockDiffusionDrafter
from .policy import BlockPilotPolicy
from .prompt_lookup import NgramLookup
from .routing import install_generate_routing
from .stats import SpeculationStats

__version__ = "0.1.0.dev0"

AutoConfig.register(BlockDiffusionConfig.model_type, BlockDiffusionConfig, exist_ok=True)
AutoModel.register(BlockDiffusionConfig, BlockDiffusionDrafter, exist_ok=True)
install_generate_routing()

__all__ = [
    "AcceptanceEMA",
    "AdaptiveVerify",
    "BlockDiffusionConfig",
    "BlockDiffusionDrafter",
    "BlockPilotPolicy",
    "BlockSizePolicy",
    "CostModel",
    "DraftController",
    "EntropyStop",
    "HeuristicSchedule",
    "NgramLookup",
    "PolicyBlockSize",
    "SpeculationGuard",
    "SpeculationStats",
    "default_controller",
    "generate",
]

#: Names once exported here, now imported from their modules (a DeprecationWarning says where).
_MOVED_NAMES = {
    "AcceptanceModel": "hf_blockpilot.controllers",
    "BatchSpeculationStats": "hf_blockpilot.stats",
    "DelegatingController": "hf_blockpilot.controllers",
    "DraftedRound": "hf_blockpilot.controllers",
    "EntropyBound": "hf_blockpilot.controllers",
    "LastLogitsMLPPolicy": "hf_blockpilot.policy",
    "PrefillMLPPolicy": "hf_blockpilot.policy",
    "build_target_layer_ids": "hf_blockpilot.configuration_block_diffusion",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED_NAMES:
        module = _MOVED_NAMES[name]
        warnings.warn(f"hf_blockpilot.{name} is deprecated: import it from {module}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'hf_blockpilot' has no attribute {name!r}")
