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

from transformers import AutoConfig, AutoModel

from .configuration_block_diffusion import BlockDiffusionConfig
from .controllers import (
    AdaptiveVerify,
    BlockSizePolicy,
    DraftController,
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
    "AdaptiveVerify",
    "BlockDiffusionConfig",
    "BlockDiffusionDrafter",
    "BlockPilotPolicy",
    "BlockSizePolicy",
    "CostModel",
    "DraftController",
    "NgramLookup",
    "PolicyBlockSize",
    "SpeculationGuard",
    "SpeculationStats",
    "default_controller",
    "generate",
]
