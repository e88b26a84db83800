"""hf-blockpilot: block-diffusion (DFlash) speculative decoding for Transformers, with per-request block sizes.

    import hf_blockpilot
    drafter = hf_blockpilot.BlockDiffusionDrafter.from_pretrained("z-lab/Qwen3-4B-DFlash-b16")
    target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
    target.generate(**inputs, assistant_model=drafter, draft_controller=hf_blockpilot.AdaptiveVerify(16))
    drafter.last_stats.tau

Importing the package registers the drafter with `AutoConfig`/`AutoModel` and routes
`generate(assistant_model=<BlockDiffusionDrafter>)` to the block-diffusion candidate generator.
"""

from transformers import AutoConfig, AutoModel

from . import _moved
from .candidate_generator import (
    BlockDiffusionCandidateGenerator,
    install_generate_routing,
)
from .configuration_block_diffusion import BlockDiffusionConfig, build_target_layer_ids
from .controllers import (
    AcceptanceEMA,
    AcceptanceModel,
    AdaptiveVerify,
    BlockSizePolicy,
    DraftController,
    DraftedRound,
    EntropyBound,
    EntropyStop,
    HeuristicSchedule,
    PolicyBlockSize,
)
from .costs import CostModel
from .cpu_kernels import (
    cpu_verify_kernels,
    grouped_query_attention,
    skinny_linear,
    skinny_linears,
    use_cpu_verify_kernels,
    use_skinny_linears,
)
from .modeling_block_diffusion import BlockDiffusionDrafter
from .policy import BlockPilotPolicy
from .prompt_lookup import NgramLookup
from .stats import SpeculationStats

__version__ = "0.1.0.dev0"

AutoConfig.register(BlockDiffusionConfig.model_type, BlockDiffusionConfig, exist_ok=True)
AutoModel.register(BlockDiffusionConfig, BlockDiffusionDrafter, exist_ok=True)
install_generate_routing()
_moved.install()

__all__ = [
    "AcceptanceEMA",
    "AcceptanceModel",
    "AdaptiveVerify",
    "BlockSizePolicy",
    "CostModel",
    "DraftController",
    "DraftedRound",
    "EntropyBound",
    "EntropyStop",
    "HeuristicSchedule",
    "PolicyBlockSize",
    "BlockDiffusionCandidateGenerator",
    "BlockDiffusionConfig",
    "BlockDiffusionDrafter",
    "BlockPilotPolicy",
    "NgramLookup",
    "SpeculationStats",
    "build_target_layer_ids",
    "cpu_verify_kernels",
    "grouped_query_attention",
    "skinny_linear",
    "skinny_linears",
    "use_cpu_verify_kernels",
    "use_skinny_linears",
]
