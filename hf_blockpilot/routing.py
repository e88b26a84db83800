"""`generate(assistant_model=<BlockDiffusionDrafter>)` after `import hf_blockpilot`: one wrapper of the public
`generate` that hands such a call to Transformers' own `custom_generate` seam (`hf_blockpilot.generate`); every
other call, and every other assistant, runs stock Transformers untouched. No private `GenerationMixin` method is
replaced. Opt out with `hf_blockpilot.routing.uninstall_generate_routing()` (the `custom_generate` form keeps
working), or never wrap by setting `HF_BLOCKPILOT_NO_ROUTING=1` before the import.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from transformers import StoppingCriteriaList
from transformers.generation import GenerationMixin
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.streamers import BaseStreamer

from .controllers import DraftController
from .custom_generate import generate
from .modeling_block_diffusion import BlockDiffusionDrafter

_stock_generate = GenerationMixin.generate


@functools.wraps(_stock_generate)
def _generate(self: GenerationMixin, *args: Any, draft_controller: DraftController | int | None = None, **kwargs: Any):
    drafter = kwargs.get("assistant_model")
    if isinstance(drafter, BlockDiffusionDrafter):
        return generate_with_drafter(self, *args, draft_controller=draft_controller, **kwargs)
    if draft_controller is not None and kwargs.get("custom_generate") is None:
        raise ValueError(
            "draft_controller= steers block-diffusion drafting: pass it with "
            "assistant_model=<BlockDiffusionDrafter> (or custom_generate=hf_blockpilot.generate, drafter=...)"
        )
    if draft_controller is not None:  # the custom decoding loop's own keyword (hf_blockpilot.generate takes it)
        kwargs["draft_controller"] = draft_controller
    return _stock_generate(self, *args, **kwargs)


def generate_with_drafter(
    model: GenerationMixin,
    *args: Any,
    assistant_model: BlockDiffusionDrafter,
    streamer: BaseStreamer | None = None,
    draft_controller: DraftController | int | None = None,
    **kwargs: Any,
) -> Any:
    """`model.generate(*args, assistant_model=drafter, streamer=..., **kwargs)` as Transformers' callable
    `custom_generate=hf_blockpilot.generate` runs it: the drafter goes as `drafter=`, the streamer as `stream=`, and
    `stop_strings` (with `tokenizer=`) as a stopping criterion, since such a callable is handed none of them."""
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "assistant_model=<BlockDiffusionDrafter> already runs custom_generate=hf_blockpilot.generate: pass either "
            "the assistant or a custom_generate, not both"
        )
    _stop_strings_as_criteria(model, kwargs)
    return _stock_generate(
        model,
        *args,
        custom_generate=generate,
        drafter=assistant_model,
        draft_controller=draft_controller,
        stream=streamer,
        **kwargs,
    )


def _stop_strings_as_criteria(model: GenerationMixin, kwargs: dict[str, Any]) -> None:
    """Turn the call's `stop_strings` into a `StopStringCriteria` among its stopping criteria: Transformers hands a
    callable `custom_generate` no tokenizer, so it could not build one itself."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("`stop_strings` needs `tokenizer=` passed to generate() (the model's tokenizer).")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


def install_generate_routing() -> None:
    """Wrap the public `GenerationMixin.generate` (idempotent; not with `HF_BLOCKPILOT_NO_ROUTING=1`)."""
    if os.environ.get("HF_BLOCKPILOT_NO_ROUTING", "") not in ("", "0"):
        return
    GenerationMixin.generate = _generate


def uninstall_generate_routing() -> None:
    """Restore stock `GenerationMixin.generate`."""
    GenerationMixin.generate = _stock_generate
