"""The decoding loop's entry, reached through Transformers' own seam with nothing patched:

    model.generate(**inputs, custom_generate=hf_blockpilot.generate, drafter=drafter, max_new_tokens=256)

Transformers (5.17 and later) prepares the call as usual (processors, stopping criteria, cache, lengths) and hands
the decoding loop to `generate` below, which runs the package's one loop (`hf_blockpilot.batched`) for any batch
size. A callable `custom_generate` receives no `assistant_model` and no `streamer` from Transformers, so the drafter
comes as `drafter=` and a streamer as `stream=`. After `import hf_blockpilot`, `generate(assistant_model=drafter)`
is routed here (`hf_blockpilot.routing`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batched import BatchedSpeculativeDecoder, static_capacity
from .controllers import DraftController, resolve_controller
from .costs import CostModel
from .device_calibration import compiled_cost_model, resolve_cost_model
from .exact_verify import verify_view
from .modeling_block_diffusion import BlockDiffusionDrafter

#: `generate(..., compile=True)`: inductor, shapes made dynamic where they vary, graph breaks allowed.
COMPILE_CONFIG = CompileConfig(fullgraph=False, mode="default")


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: BlockDiffusionDrafter | None = None,
    draft_controller: DraftController | int | None = None,
    stream: BaseStreamer | None = None,
    prompt_lookup: bool | None = None,
    calibrate: bool | None = None,
    compile: bool | CompileConfig = False,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop `model.generate(custom_generate=hf_blockpilot.generate, drafter=drafter)` runs:
    lossless speculative decoding with `drafter`, streaming one row to `stream` if given. This call's settings
    (the drafter's attributes and the environment are only their defaults):

    - `draft_controller`: widths and verify budgets (default: the drafter's policy under the speculation guard);
    - `prompt_lookup`: draft repeated text by lookup (default `drafter.prompt_lookup`);
    - `calibrate`: weigh this machine's measured costs, calibrating once if needed (default: on unless
      `HF_BLOCKPILOT_CALIBRATE=0`); off, the shipped fallback table;
    - `compile`: the target's forwards after the prefill and the drafter's block forwards run `torch.compile`d
      (a `CompileConfig`, or True for `COMPILE_CONFIG`) over static caches; decisions weigh the compiled forwards'
      own timings, and a warning says where they are probed not to round as plain decoding's steps. The first call
      pays the compilation.

    Returns the sequences, or with `return_dict_in_generate=True` an output carrying them (and the scores, logits,
    attentions or hidden states asked for, one row) and this call's `speculation_stats`."""
    if not isinstance(drafter, BlockDiffusionDrafter):
        raise TypeError(
            "custom_generate=hf_blockpilot.generate drafts with drafter=<BlockDiffusionDrafter> (Transformers passes "
            f"no assistant_model to a callable custom_generate); got drafter={type(drafter).__name__}"
        )
    for name in ("output_attentions", "output_hidden_states"):  # asked for as model inputs: returned per step
        if model_kwargs.pop(name, None):
            setattr(generation_config, name, True)
    rows = input_ids.shape[0]
    controller = prepare_controller(model, drafter, draft_controller, rows, calibrate)
    compiled = compiled_drafter = capacity = None
    if compile:
        if generation_config.output_attentions:
            raise ValueError("compile=True returns no attentions (its static cache pads them): drop one of the two")
        config = COMPILE_CONFIG if compile is True else compile
        compiled, compiled_drafter = model.get_compiled_call(config), drafter.compiled_forward(config)
        capacity = static_capacity(generation_config.max_length, controller.max_width())
        controller.use_cost_model(
            compiled_cost_model(
                model, compiled, controller.cost_model, controller.max_width(), capacity, drafter, compiled_drafter
            )
        )
    warn_if_inexact(controller.cost_model, compiled is not None)
    # compiled forwards take no exact path (warned); a single row's one-token steps run on the view too, where its
    # one-row products and one-query attention are computed as plain decoding's, faster where calibrated or probed so;
    # a batch's lockstep steps where the calibration timed the view's faster than the stock model's
    way = controller.cost_model.step_way(rows)
    view = model if compile else verify_view(model, rows, way if rows == 1 else "stock")
    steps_on_view = rows == 1 or way == "view"
    decoder = BatchedSpeculativeDecoder(
        view,
        drafter,
        controller,
        input_ids,
        generation_config,
        logits_processor,
        stopping_criteria,
        stream,
        model_kwargs,
        plain_target=view if steps_on_view else model,
        prompt_lookup=prompt_lookup,
        compiled=compiled,
        capacity=capacity,
        compiled_drafter=compiled_drafter,
    )
    sequences = decoder.run()
    if not generation_config.return_dict_in_generate:
        return sequences
    returned = decoder.returned.as_output_fields() if decoder.returned is not None else {}
    output = GenerateDecoderOnlyOutput(sequences=sequences, **returned)
    output.speculation_stats = decoder.call_stats
    return output


def prepare_controller(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    controller: DraftController | int | None,
    batch_size: int = 1,
    calibrate: bool | None = None,
) -> DraftController:
    """This request's own controller (`resolve_controller`), checked against the pair and given the device's
    costs (`resolve_cost_model`: its own, else this machine's calibration unless `calibrate` is off, else the
    shipped fallback; with its batch axis measured at `batch_size` for a batched call)."""
    drafter.check_compatible(target)
    prepared = resolve_controller(drafter, controller).for_request()
    prepared.check_compatible(target, drafter)
    cost = resolve_cost_model(
        target, drafter, prepared.cost_model, prepared.max_width(), batch_size=batch_size, calibrate=calibrate
    )
    prepared.use_cost_model(cost)
    return prepared


def warn_if_inexact(cost: CostModel, compiled: bool = False) -> None:
    """Say where this machine's verify forwards (`compiled` ones) were probed not to round as plain decoding's
    eager one-token steps, and what gives token-identical output instead."""
    if cost.inexact_rows:
        path, remedy = (
            ("compiled", "decode without compile= (the exact eager path)")
            if compiled
            else ("even on the exact path", "decode in another dtype (`--dtype auto` picks a lossless one)")
        )
        warnings.warn(
            f"hf-blockpilot: {cost.source}: verify forwards over {cost.inexact_rows} tokens, {path}, do not give the "
            "logits of plain decoding's one-token steps bit for bit on this machine, so greedy output may differ "
            f"from plain `generate` in this dtype where two tokens nearly tie; {remedy} for token-identical output",
            stacklevel=4,
        )
