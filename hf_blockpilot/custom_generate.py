"""Block-diffusion speculative decoding through Transformers' own seam, with nothing patched:

    model.generate(**inputs, custom_generate=hf_blockpilot.generate, drafter=drafter, max_new_tokens=256)

Transformers (5.17 and later) prepares the call as usual (processors, stopping criteria, cache, lengths) and hands
the decoding loop to `generate` below, which runs the package's own loop for any batch size. A callable
`custom_generate` receives no `assistant_model` and no `streamer` from Transformers, so the drafter comes as
`drafter=`; for streamers, output scores and custom stopping criteria use `generate(assistant_model=drafter)`
after `import hf_blockpilot` (Transformers' assisted loop at batch size 1).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .candidate_generator import batched_decoder, prepare_controller, use_call_kernels
from .controllers import DraftController
from .modeling_block_diffusion import BlockDiffusionDrafter


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: BlockDiffusionDrafter | None = None,
    draft_controller: DraftController | int | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop `model.generate(custom_generate=hf_blockpilot.generate, drafter=drafter)` runs:
    lossless speculative decoding with `drafter` and `draft_controller` (default: the drafter's policy under the
    speculation guard, as `generate(assistant_model=drafter)`). Returns the sequences, or with
    `return_dict_in_generate=True` an output carrying them and this call's `speculation_stats`."""
    if not isinstance(drafter, BlockDiffusionDrafter):
        raise TypeError(
            "custom_generate=hf_blockpilot.generate drafts with drafter=<BlockDiffusionDrafter> (Transformers passes "
            f"no assistant_model to a callable custom_generate); got drafter={type(drafter).__name__}"
        )
    rows = input_ids.shape[0]
    controller = prepare_controller(model, drafter, draft_controller, rows)
    view, end_kernels = use_call_kernels(model, controller, model_kwargs.get("attention_mask"), rows)
    try:
        decoder = batched_decoder(
            view,
            drafter,
            controller,
            input_ids,
            generation_config,
            logits_processor,
            stopping_criteria,
            None,
            model_kwargs,
            (
                "custom_generate=hf_blockpilot.generate",
                "Use generate(assistant_model=drafter) after `import hf_blockpilot` for them.",
            ),
        )
        sequences = decoder.run()
    finally:
        end_kernels()
    if not generation_config.return_dict_in_generate:
        return sequences
    output = GenerateDecoderOnlyOutput(sequences=sequences)
    output.speculation_stats = decoder.stats
    return output
