"""Block-diffusion candidate generator and its routing inside `generate()`.

After `import hf_blockpilot`, `target.generate(..., assistant_model=drafter)` with a `BlockDiffusionDrafter`
builds a `BlockDiffusionCandidateGenerator`; every other assistant goes through stock Transformers.
`generate(..., draft_controller=...)` passes a `DraftController` for that call (default: the drafter's policy,
else its `block_size`).

Round by round, inside Transformers' own assisted-decoding loop:
  round 0: no candidates, so the loop's first target forward is the plain prefill;
  after it: the controller sees the prefill once (a policy picks the drafting width);
  each round: context K/V of newly verified tokens -> one drafter forward over [last, MASK x (w-1)] ->
  the controller keeps a prefix of the w-1 drafts for the target to verify; drafts are sampled (T>0) from
  exactly the logits returned to the loop; with `drafter.prompt_lookup`, a round whose last tokens occurred
  earlier drafts their continuation there instead (one-hot logits; the drafter only takes in the new context).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation import GenerationMixin, GenerationMode
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from ._compat import LOOP_CHECKS_CANDIDATES_FOR_STOP, SELECTION_KEEPS_POSITIONS
from .batched import (
    BatchedSpeculativeDecoder,
    check_batched_call,
    check_prompt_not_cached,
    pick_tokens,
    request_temperature,
)
from .controllers import DraftController, DraftedRound, SpeculationGuard, resolve_controller
from .cpu_kernels import set_verifying, use_verify_kernels
from .device_calibration import resolve_cost_model
from .modeling_block_diffusion import BlockDiffusionDrafter, DraftContextCache
from .prompt_lookup import NgramLookup
from .stats import BatchSpeculationStats, SpeculationStats

if TYPE_CHECKING:
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )


class BlockDiffusionCandidateGenerator(CandidateGenerator):
    """Drafts a block of `b - 1` tokens per round with one forward of a `BlockDiffusionDrafter`.

    The drafter's context is the target's hidden states of *verified* tokens only, taken from the target
    forwards the loop runs anyway (`output_hidden_states`), so no target compute is added.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True}  # set per request in __init__

    def __init__(
        self,
        drafter: BlockDiffusionDrafter,
        target: PreTrainedModel,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        target_tokenizer: PreTrainedTokenizerBase | None = None,
        controller: DraftController | int | None = None,
        prepared: bool = False,
    ):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"this candidate generator drafts for one row, got {input_ids.shape[0]} (batches run batched.py)"
            )
        # `prepared`: `controller` is already this request's own, checked and costed (`prepare_controller`)
        self.controller = controller if prepared else prepare_controller(target, drafter, controller)
        self.kernel_rows = self.controller.cost_model.kernel_rows
        self.drafter = drafter
        self.device = drafter.device
        self.embed_tokens = target.get_input_embeddings()
        self.head_weight, self.head_bias = drafter.draft_head(target.get_output_embeddings())
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = request_temperature(generation_config)
        self.target_head = target.get_output_embeddings()
        self.logits_processor = logits_processor
        self.eos_token_ids = getattr(generation_config, "_eos_token_tensor", None)
        self.stop_strings = None
        if generation_config.stop_strings:
            if target_tokenizer is None:
                raise ValueError("`stop_strings` needs `tokenizer=` passed to generate().")
            self.stop_strings = StopStringCriteria(target_tokenizer, generation_config.stop_strings)
        self.cache = DraftContextCache()
        self.pending_context: list[torch.Tensor] = []  # target states of tokens verified in rounds not drafted
        self.lookup = NgramLookup() if drafter.prompt_lookup else None
        self.started = False
        self.stats = SpeculationStats(
            prompt_tokens=input_ids.shape[1],
            controller=self.controller.describe(),
            cost_model_source=self.controller.cost_model.source,
        )
        drafter.last_stats = self.stats
        # the user's own request for hidden states (returned by generate) gets them all, as with any assistant
        wants_all = bool(generation_config.output_hidden_states)
        keep = True if wants_all else hidden_states_to_keep(drafter, self.controller)
        self.model_kwargs_overrides = {"output_hidden_states": keep}

    # ------------------------------------------------------------------------------------ main contract
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Return `input_ids` extended by the drafts, and the (processed) logits the drafts were drawn from."""
        self.stats.target_forwards += 1  # every call is followed by exactly one target forward
        if is_first_iteration:
            if LOOP_CHECKS_CANDIDATES_FOR_STOP and bool(self._stops(input_ids, first=input_ids.shape[1] - 1).any()):
                # Such a loop would stop before the first token. One placeholder candidate is verified like
                # any draft (kept only if the target picks it), so the output is unchanged.
                placeholder = self._placeholder_token(input_ids)
                self.stats.drafted_per_round.append(1)
                self.stats.widths_per_round.append(2)
                return torch.cat([input_ids, placeholder], dim=-1), None
            self.stats.drafted_per_round.append(0)
            self.stats.widths_per_round.append(1)
            return input_ids, None
        if not self.started:
            self._start(model_outputs)
        # As the reference loop: a block never reaches past max_length (the last rounds draft only the room
        # left), and the last allowed token is always the target's own, so at most room - 1 drafts are kept.
        room = self.max_length - input_ids.shape[1]
        width = min(self.controller.width(), room + 1)
        num_drafts = min(width - 1, room - 1)
        if num_drafts <= 0:  # speculation off (b = 1) or one token left before max_length
            if self.controller.max_width() > 1:  # drafting may resume in a later round
                self._keep_context(input_ids, model_outputs)
            self.stats.widths_per_round.append(1)
            self.stats.drafted_per_round.append(0)
            return input_ids, None
        self.stats.widths_per_round.append(width)
        looked_up = self.lookup.continuation(input_ids, num_drafts) if self.lookup is not None else []
        if looked_up:
            drafts, logits = self._lookup_drafts(input_ids, model_outputs, looked_up)
            keep = self._num_to_verify(DraftedRound(len(looked_up), lookup=True))
            drafts, logits = drafts[:, :keep], logits[:, :keep]
        else:
            logits, draft_vocab_logits, hidden = self._draft_logits(input_ids, model_outputs, width)
            keep = self._num_to_verify(self._drafted_round(draft_vocab_logits[:, :num_drafts]))
            selector = self.drafter.candidate_selector
            score = selector.scorer(hidden[:, :keep], logits[:, :keep]) if selector is not None else None
            drafts, logits = self._select(input_ids, logits[:, :keep], score)
        drafts, logits = self._cut_before_stop(input_ids, drafts, logits)
        self.stats.drafted_per_round.append(drafts.shape[1])
        if drafts.shape[1] == 0:
            return input_ids, None
        set_verifying(True)  # the target forward that follows verifies them (until `update_candidate_strategy`)
        return torch.cat([input_ids, drafts], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: Any) -> None:
        """Record the round's outcome and tell the controller."""
        set_verifying(False)
        accepted = int(num_matches)
        self.stats.accepted_per_round.append(accepted)
        self.stats.new_tokens = input_ids.shape[1] - self.stats.prompt_tokens
        self.controller.observe(self.stats.drafted_per_round[-1], accepted)

    # --------------------------------------------------------------------------------------- the steps
    def _start(self, prefill_outputs: Any) -> None:
        """Once per request, after the prefill: the controller reads it (a policy picks the width)."""
        self.controller.start(prefill_outputs, self.target_head, self.temperature)
        self.started = True
        self.stats.block_size = self.controller.width()
        self.stats.policy_seconds = self.controller.policy_seconds
        self.stats.policy_probs = self.controller.policy_probs

    def _num_to_verify(self, drafted: DraftedRound) -> int:
        """The controller's per-round decision, timed (its overhead is reported in the stats)."""
        start = time.perf_counter()
        keep = min(max(self.controller.num_to_verify(drafted), 0), drafted.num_drafts)
        self.stats.controller_seconds += time.perf_counter() - start
        return keep

    def _drafted_round(self, logits: torch.Tensor) -> DraftedRound:
        """Per-slot confidence and entropy of the draft distributions, for controllers that read them.

        Taken from the drafter's logits at the request's temperature, before any logits processor and before
        any draw, so they never depend on which tokens get drafted: deciding from them keeps sampling exact.
        `logits` may be over the drafter's reduced vocabulary (the ids outside it have probability 0).
        """
        num_drafts = logits.shape[1]
        if not self.controller.reads_confidence:
            return DraftedRound(num_drafts)
        start = time.perf_counter()
        raw = logits[0].detach()
        probs = torch.softmax(raw / self.temperature if self.temperature > 0 else raw, dim=-1)
        confidence, entropy = probs.amax(dim=-1), torch.special.entr(probs).sum(dim=-1)
        self.stats.controller_seconds += time.perf_counter() - start
        return DraftedRound(num_drafts, confidence=confidence, entropy=entropy)

    def _keep_context(self, input_ids: torch.LongTensor, model_outputs: Any) -> None:
        """Hold the target states of the tokens verified since the last round (at the drafter's layers) until
        the drafter next runs: rounds that draft nothing (a plain step) add them without a drafter forward."""
        pending = sum(h.shape[1] for h in self.pending_context)
        num_new = input_ids.shape[1] - 1 - self.cache.get_seq_length() - pending  # all committed but the last
        if num_new <= 0:
            return
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None or hidden_states[self.drafter.target_layer_ids[0] + 1].shape[1] < num_new:
            raise RuntimeError(
                "the target forward did not return hidden states for all verified tokens; block-diffusion drafting "
                "needs a target that honours `output_hidden_states` and a prompt that is not pre-cached."
            )
        hidden = torch.cat([hidden_states[i + 1][:, :num_new] for i in self.drafter.target_layer_ids], dim=-1)
        self.pending_context.append(hidden.to(self.device))

    def _new_context(self, input_ids: torch.LongTensor, model_outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Target hidden states (at the drafter's layers) and positions of tokens verified since the drafter
        last ran."""
        self._keep_context(input_ids, model_outputs)
        seen = self.cache.get_seq_length()
        target_hidden = torch.cat(self.pending_context, dim=1)
        self.pending_context = []
        positions = torch.arange(seen, seen + target_hidden.shape[1], device=self.device).unsqueeze(0)
        return target_hidden, positions

    def _draft_logits(
        self, input_ids: torch.LongTensor, model_outputs: Any, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafter forward over [new context ; last token, MASK x (width-1)]: logits of slots 1..width-1.

        Returns full-vocabulary float logits (with a reduced draft vocabulary, ids outside it get -inf, so they
        are exactly the distribution drafts are drawn from), the same logits over the draft vocabulary, and
        the slots' hidden states (a DFlash 2 selector reads them).
        """
        target_hidden, context_positions = self._new_context(input_ids, model_outputs)
        block_ids = torch.full((1, width), self.drafter.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, 0] = input_ids[0, -1]
        start = input_ids.shape[1] - 1
        block_positions = torch.arange(start, start + width, device=self.device).unsqueeze(0)
        block_embeds = self.drafter.embed_block(self.embed_tokens, block_ids).to(self.device)
        hidden = self.drafter(
            block_embeds=block_embeds,
            block_position_ids=block_positions,
            target_hidden=target_hidden,
            context_position_ids=context_positions,
            cache=self.cache,
        ).last_hidden_state[:, 1:]
        self.stats.drafter_forwards += 1
        # the head may sit on another device than the drafter (a target spread over devices)
        logits = self.drafter.head_logits(hidden, self.head_weight, self.head_bias, self.kernel_rows)
        return self.drafter.full_vocabulary(logits, self.vocab_size), logits, hidden

    def _lookup_drafts(
        self, input_ids: torch.LongTensor, model_outputs: Any, looked_up: list[int]
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Drafts copied by prompt lookup, with one-hot logits (their exact draft distribution); the drafter
        takes in the new context without drafting, so its cache stays complete for later rounds."""
        target_hidden, context_positions = self._new_context(input_ids, model_outputs)
        self.drafter.extend_context(target_hidden, context_positions, self.cache)
        self.stats.lookup_rounds += 1
        drafts = torch.tensor([looked_up], dtype=torch.long, device=input_ids.device)
        logits = torch.full((1, len(looked_up), self.vocab_size), float("-inf"), device=input_ids.device)
        return drafts, logits.scatter_(-1, drafts.unsqueeze(-1), 0.0)

    def _select(
        self, input_ids: torch.LongTensor, logits: torch.Tensor, score: Any = None
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Apply the logits processors position by position and pick drafts from exactly those logits.

        `score(i, previous)` (DFlash 2's candidate selector) replaces slot i's logits by ones that depend on the
        draft picked before it, so slots are then picked left to right.
        """
        if not self.logits_processor and score is None:
            return self._pick(logits), logits
        ids = input_ids
        processed = torch.empty_like(logits)
        for i in range(logits.shape[1]):
            raw = logits[:, i] if score is None else score(i, ids[:, -1])
            processed[:, i] = self.logits_processor(ids, raw) if self.logits_processor else raw
            ids = torch.cat([ids, self._pick(processed[:, i : i + 1])], dim=-1)
        return ids[:, input_ids.shape[1] :], processed

    def _pick(self, logits: torch.Tensor) -> torch.LongTensor:
        return pick_tokens(logits, self.do_sample)

    def _cut_before_stop(
        self, input_ids: torch.LongTensor, drafts: torch.LongTensor, logits: torch.Tensor
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Drop drafts from the first one that would end generation (EOS or a stop string) onwards.

        The target then commits that token itself as the round's bonus token, the last one committed, so
        generation stops exactly where plain `generate` stops, on every Transformers 5.x loop. This keeps
        sampling exact: whether a position carries a draft depends only on tokens before it.
        """
        stops = self._stops(torch.cat([input_ids, drafts], dim=-1), first=input_ids.shape[1])
        if not bool(stops.any()):
            return drafts, logits
        keep = int(stops[0].int().argmax())
        return drafts[:, :keep], logits[:, :keep]

    def _stops(self, ids: torch.LongTensor, first: int) -> torch.Tensor:
        """(1, n - first) bool: would generation stop right after `ids[:, i]`, for i >= first (EOS, or a stop
        string ending there)."""
        stops = (
            torch.isin(ids[:, first:], self.eos_token_ids.to(ids.device))
            if self.eos_token_ids is not None
            else (torch.zeros_like(ids[:, first:], dtype=torch.bool))
        )
        if self.stop_strings is not None:
            for i, end in enumerate(range(first + 1, ids.shape[1] + 1)):
                stops[:, i] |= self.stop_strings(ids[:, :end], None).to(ids.device)
        return stops

    def _placeholder_token(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """A token that ends nothing (the mask token unless it is an EOS id)."""
        token = self.drafter.mask_token_id
        eos = set() if self.eos_token_ids is None else set(self.eos_token_ids.view(-1).tolist())
        while token in eos:
            token = (token + 1) % self.vocab_size
        return torch.full((1, 1), token, dtype=torch.long, device=input_ids.device)


def hidden_states_to_keep(drafter: BlockDiffusionDrafter, controller: DraftController) -> bool | list[int]:
    """The target's hidden states that the drafter (and the controller's policy) read, as `hidden_states` indices.

    Where Transformers keeps a selection at its usual positions (5.23), only those are held, which saves
    memory on long prompts; older releases index a selection differently, so they get all of them.
    """
    if not SELECTION_KEEPS_POSITIONS:
        return True
    controller_states = controller.prefill_state_indices()
    if controller_states is None:  # a policy of another kind may read any of them
        return True
    return sorted({i + 1 for i in drafter.target_layer_ids} | controller_states)


_stock_get_candidate_generator = GenerationMixin._get_candidate_generator
_stock_assisted_decoding = GenerationMixin._assisted_decoding
_stock_validate_generation_mode = GenerationMixin._validate_generation_mode
_stock_generate = GenerationMixin.generate


@dataclasses.dataclass
class _Call:
    """One `generate` call's own controller, its batch size, and the statistics its generator records."""

    controller: DraftController
    batch_size: int = 1
    stats: SpeculationStats | BatchSpeculationStats | None = None


# The `generate` call running in this thread / task (generate runs synchronously).
_current_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("hf_blockpilot_call", default=None)


def prepare_controller(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    controller: DraftController | int | None,
    batch_size: int = 1,
) -> DraftController:
    """This request's own controller (`resolve_controller`), checked against the pair and given the device's
    costs (`resolve_cost_model`: its own, else this machine's calibration, else the shipped fallback; with its
    batch axis measured at `batch_size` for a batched call)."""
    drafter.check_compatible(target)
    prepared = resolve_controller(drafter, controller).for_request()
    prepared.check_compatible(target, drafter)
    cost = resolve_cost_model(target, drafter, prepared.cost_model, prepared.max_width(), batch_size=batch_size)
    if cost.inexact_rows:
        warnings.warn(
            f"hf-blockpilot: {cost.source}: verify forwards over {cost.inexact_rows} tokens do not give the logits "
            "of plain decoding's one-token steps bit for bit on this machine, even on the exact path, so greedy "
            "output may differ from plain `generate` in this dtype where two tokens nearly tie; decode in another "
            "dtype (`--dtype auto` picks a lossless one) for token-identical output",
            stacklevel=3,
        )
    prepared.use_cost_model(cost)
    return prepared


def use_call_kernels(
    target: PreTrainedModel, controller: DraftController, attention_mask: torch.Tensor | None, rows: int
) -> tuple[PreTrainedModel, Callable[[], None]]:
    """The verify kernels one call decodes with (`use_verify_kernels`): its calibrated kernel rows, the exact path
    where verifies need one; a batch verifies with the stock kernels, as its batch axis was timed (the kernel rows
    are batch 1's). Returns the model the call runs (a per-call view of `target` where kernels are on: nothing
    another thread can see) and what ends the call's kernel settings."""
    unpadded = attention_mask is None or bool(attention_mask.all())  # once per call
    return use_verify_kernels(target, controller.cost_model.kernel_rows, unpadded, rows)


def _batch_size(args: tuple, kwargs: dict[str, Any]) -> int:
    """The batch size of a `generate` call (1 when its inputs are not a tensor of token ids)."""
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if inputs is None:
        inputs = kwargs.get("attention_mask")
    num_return = getattr(kwargs.get("generation_config"), "num_return_sequences", None)
    rows = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1
    return rows * int(kwargs.get("num_return_sequences") or num_return or 1)


@functools.wraps(_stock_generate)
def _generate(self: GenerationMixin, *args: Any, draft_controller: DraftController | int | None = None, **kwargs: Any):
    drafter = kwargs.get("assistant_model")
    if not isinstance(drafter, BlockDiffusionDrafter):
        if draft_controller is not None and kwargs.get("custom_generate") is None:
            raise ValueError(
                "draft_controller= steers block-diffusion drafting: pass it with "
                "assistant_model=<BlockDiffusionDrafter> (or custom_generate=hf_blockpilot.generate, drafter=...)"
            )
        if draft_controller is not None:  # the custom decoding loop's own keyword (hf_blockpilot.generate takes it)
            kwargs["draft_controller"] = draft_controller
        return _stock_generate(self, *args, **kwargs)
    batch_size = _batch_size(args, kwargs)
    # bad input fails before any forward
    call = _Call(prepare_controller(self, drafter, draft_controller, batch_size), batch_size)
    model, end_kernels = use_call_kernels(self, call.controller, kwargs.get("attention_mask"), batch_size)
    token = _current_call.set(call)
    try:
        output = _stock_generate(model, *args, **kwargs)
    finally:
        _current_call.reset(token)
        end_kernels()
    if isinstance(output, ModelOutput):  # return_dict_in_generate=True: this call's statistics travel with it
        output.speculation_stats = call.stats
    return output


def _validate_generation_mode(
    self: GenerationMixin, generation_mode: Any, generation_config: Any, kwargs: dict
) -> None:
    # the drafter was checked against the target by `prepare_controller`, before stock `generate` began (so a
    # wrong drafter is named as such, not as a tokenizer mismatch); here only the mode is left to check
    drafter = kwargs.get("assistant_model")
    if isinstance(drafter, BlockDiffusionDrafter):
        call = _current_call.get()
        if generation_mode != GenerationMode.ASSISTED_GENERATION and call is not None and call.batch_size > 1:
            raise ValueError(
                f"block-diffusion speculative decoding with batch size > 1 does not support generation mode "
                f"{generation_mode.value} (e.g. num_beams > 1): use greedy search or sampling (num_beams=1), or "
                "generate without assistant_model."
            )
        if generation_mode != GenerationMode.ASSISTED_GENERATION:  # Transformers then ignores the assistant
            warnings.warn(
                f"generation mode is {generation_mode.value} (e.g. num_beams > 1), so Transformers does not use the "
                "drafter: block-diffusion speculative decoding runs with greedy search or sampling (num_beams=1).",
                stacklevel=3,
            )
    _stock_validate_generation_mode(self, generation_mode, generation_config, kwargs)


def _get_candidate_generator(
    self: GenerationMixin,
    generation_config: GenerationConfig,
    input_ids: torch.LongTensor,
    inputs_tensor: torch.Tensor,
    logits_processor: LogitsProcessorList,
    model_kwargs: dict[str, Any],
    assistant_model: PreTrainedModel | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    assistant_tokenizer: PreTrainedTokenizerBase | None = None,
) -> CandidateGenerator:
    if isinstance(assistant_model, BlockDiffusionDrafter):
        check_prompt_not_cached(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
        call = _current_call.get()
        generator = BlockDiffusionCandidateGenerator(
            drafter=assistant_model,
            target=self,
            input_ids=input_ids,
            generation_config=generation_config,
            logits_processor=logits_processor,
            target_tokenizer=target_tokenizer,
            controller=call.controller if call is not None else None,
            prepared=call is not None,
        )
        if call is not None:
            call.stats = generator.stats
        return generator
    return _stock_get_candidate_generator(
        self,
        generation_config=generation_config,
        input_ids=input_ids,
        inputs_tensor=inputs_tensor,
        logits_processor=logits_processor,
        model_kwargs=model_kwargs,
        assistant_model=assistant_model,
        target_tokenizer=target_tokenizer,
        assistant_tokenizer=assistant_tokenizer,
    )


def _assisted_decoding(
    self: GenerationMixin,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: Any,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    **kwargs: Any,
):
    drafter = kwargs.get("assistant_model")
    if not isinstance(drafter, BlockDiffusionDrafter) or input_ids.shape[0] == 1:
        return _stock_assisted_decoding(
            self,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus=synced_gpus,
            streamer=streamer,
            **kwargs,
        )
    call = _current_call.get()
    controller = call.controller if call is not None else prepare_controller(self, drafter, None, input_ids.shape[0])
    decoder = batched_decoder(
        self, drafter, controller, input_ids, generation_config, logits_processor, stopping_criteria, streamer, kwargs
    )
    if call is not None:
        call.stats = decoder.stats
    sequences = decoder.run()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def batched_decoder(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    controller: DraftController,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList,
    stopping_criteria: Any,
    streamer: Any,
    kwargs: dict[str, Any],
    route: tuple[str, str] | None = None,
) -> BatchedSpeculativeDecoder:
    """The decoder of one call's rows with its prepared `controller` (`prepare_controller`), after checking that
    it serves the call (`route`: the path's name and what its error advises, `check_batched_call`'s `mode` and
    `advice`; default the batch path's); `kwargs` are the loop's keyword arguments."""
    model_kwargs = {k: v for k, v in kwargs.items() if k not in CALL_ARGUMENTS}
    check_batched_call(target, drafter, generation_config, stopping_criteria, streamer, model_kwargs, *(route or ()))
    batch_cost = controller.cost_model.for_batch(input_ids.shape[0])
    # the guard judges the batch as a whole (its rounds are shared); each row gets its own copy of the rest
    guard, per_row = None, controller
    if isinstance(controller, SpeculationGuard):
        guard, per_row = controller.for_request(), controller.inner
    controllers = [per_row.for_request() for _ in range(input_ids.shape[0])]
    for each in [guard, *controllers] if guard is not None else controllers:
        each.use_cost_model(batch_cost)
    decoder = BatchedSpeculativeDecoder(
        target,
        drafter,
        controllers,
        guard,
        input_ids,
        generation_config,
        logits_processor,
        stopping_criteria,
        model_kwargs,
        hidden_states_to_keep(drafter, controller),
    )
    drafter.last_stats = decoder.stats
    return decoder


#: `_assisted_decoding` arguments that are not model inputs.
CALL_ARGUMENTS = {"inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer"}


def install_generate_routing() -> None:
    """Route `generate(assistant_model=<BlockDiffusionDrafter>, draft_controller=...)` to our generator
    (idempotent)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin.generate = _generate
    GenerationMixin._assisted_decoding = _assisted_decoding
