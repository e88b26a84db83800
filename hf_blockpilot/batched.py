"""The decoding loop of `generate(..., assistant_model=drafter)` for every batch size (one row is a batch of one).

Per round: one drafter forward over the active rows' blocks, one target forward over each row's anchor and the
drafts its controller sends, then per row the accepted prefix plus one target token is committed (greedy: argmax
match; T > 0: speculative sampling). Rows accept ragged counts; each row's keys/values sit in the target cache as
plain decoding would hold them (`RaggedCache`), and finished rows leave the batch at once. One guard judges the
batch's shared rounds. Decisions depend only on the drafter's outputs and earlier rounds, so each row is lossless.
The design, and what a batch pads, recomputes and wastes: docs/batched.md; the compiled variant: docs/compile.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

from ._compat import SELECTION_KEEPS_POSITIONS, cache_argument
from .controllers import DraftController, DraftedRound, LookupBudget, SpeculationGuard, fastest_width
from .costs import MIN_PREDICTED_GAIN
from .exact_verify import slot_key_lengths
from .modeling_block_diffusion import BlockDiffusionDrafter, DraftContextCache, StaticDraftContextCache
from .prompt_lookup import NgramLookup
from .stats import BatchSpeculationStats, SpeculationStats

if TYPE_CHECKING:
    from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

#: Logits processors that read only the scores, never the ids before them: applied to a whole round at once.
ROW_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
)
#: Stopping criteria the loop applies in its own way (any other is called per row and per committed token).
HANDLED_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)
#: A compiled call's static cache holds a multiple of this many slots (`static_capacity`).
CAPACITY_STEP = 256
#: Model inputs a batched call may carry besides `input_ids` (the loop builds masks and positions itself).
KNOWN_MODEL_KWARGS = {"attention_mask", "cache", "past_key_values", "use_cache", "position_ids", "logits_to_keep"}


def request_temperature(generation_config: GenerationConfig) -> float:
    """The call's sampling temperature (0: greedy); a ValueError unless a sampling one is finite and > 0."""
    if not generation_config.do_sample:
        return 0.0
    temperature = float(generation_config.temperature or 1.0)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 for sampling, got {generation_config.temperature}")
    return temperature


def check_batched_call(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    generation_config: GenerationConfig,
    stopping_criteria: StoppingCriteriaList,
    streamer: Any,
    model_kwargs: dict[str, Any],
    single: bool,
) -> None:
    """Raise a ValueError naming the limit for what the loop does not serve: some things only for one unpadded
    row (`single`), others not at all."""
    problems = []
    if (generation_config.num_beams or 1) > 1:
        problems.append("beam search (num_beams > 1: use greedy search or sampling, or generate without a drafter)")
    if streamer is not None and not single:
        problems.append("a streamer for several rows (streamers take one row: stream with batch size 1)")
    wanted = [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if getattr(generation_config, name, False)
    ]
    if wanted and not single:
        problems.append(f"{', '.join(wanted)} for several rows (a batch returns sequences and speculation_stats)")
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        problems.append("assistant_ensemble_weight")
    others = sorted(k for k, v in model_kwargs.items() if v is not None and k not in KNOWN_MODEL_KWARGS)
    if others:
        problems.append(f"model inputs {others} (a batch takes input_ids and attention_mask)")
    cache = _target_cache(target, model_kwargs)
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError(
            "block-diffusion drafting reads the target's hidden states of the whole prompt, so the prompt cannot "
            f"come pre-cached ({cache.get_seq_length()} tokens in the cache passed to generate): pass the full "
            "prompt without `cache` / `past_key_values`."
        )
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        problems.append("a target with sliding-window attention layers (their cache drops entries by slot)")
    if drafter.config.has_masked_layers() and not single:
        problems.append(
            "a drafter with causal or sliding-window layers for several or padded rows (z-lab's DFlash drafters "
            "attend unmasked; call generate() per prompt)"
        )
    if problems:
        raise ValueError("block-diffusion speculative decoding does not support " + "; ".join(problems) + ".")


def _target_cache(target: PreTrainedModel, model_kwargs: dict[str, Any]) -> Any:
    cache = model_kwargs.get(cache_argument(target))
    return cache if cache is not None else model_kwargs.get("past_key_values", model_kwargs.get("cache"))


def hidden_states_to_keep(
    drafter: BlockDiffusionDrafter, controller: DraftController, wants_all: bool = False
) -> bool | list[int]:
    """The target's hidden states that the drafter (and the controller's policy) read, as `hidden_states` indices
    (less memory on long prompts); all of them where the call returns them (`wants_all`) or where Transformers
    (before 5.23) does not keep a selection at its usual positions."""
    if wants_all or not SELECTION_KEEPS_POSITIONS:
        return True
    controller_states = controller.prefill_state_indices()
    if controller_states is None:  # a policy of another kind may read any of them
        return True
    return sorted({i + 1 for i in drafter.target_layer_ids} | controller_states)


class RaggedLayer(DynamicLayer):
    """A target cache layer whose rows have their own lengths: `update` writes each row's new keys/values at the
    offsets its `RaggedCache` planned (right after the row's committed ones) and returns the first `end` slots;
    where every row holds as many keys (one row; a batch in lockstep) they are appended to the committed ones, as
    plain decoding's `DynamicLayer` appends (one `torch.cat`, cheaper at these lengths than writing into spare room
    by index and slicing it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: RaggedCache):
        super().__init__()
        self.keys, self.values, self.plan = keys, values, plan
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.plan.static:  # fixed shapes (a compiled forward): no host ints read, the whole storage returned
            self._write_at_index(key_states, value_states)
            return self.keys, self.values
        if self.plan.appends:  # rows alike long: appended as plain decoding's cache appends (rejected slots cut)
            keys, values, committed = self.keys, self.values, self.plan.host_lengths[0]
            if keys.shape[-2] != committed:
                keys, values = keys[..., :committed, :], values[..., :committed, :]
            self.keys = torch.cat([keys, key_states], dim=-2)
            self.values = torch.cat([values, value_states], dim=-2)
            return self.keys, self.values
        end = self.plan.end
        if end > self.keys.shape[-2]:  # room for as much again: growth stays rare
            self.keys, self.values = (self._grown(stored, 2 * end) for stored in (self.keys, self.values))
        self._write_at_index(key_states, value_states)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _write_at_index(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, slots = self.plan.row_index, self.plan.write_index  # (rows, 1), (rows, slots)
        self.keys.transpose(1, 2)[rows, slots] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values.transpose(1, 2)[rows, slots] = value_states.transpose(1, 2).to(self.values.dtype)

    @staticmethod
    def _grown(stored: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = stored.new_zeros(*stored.shape[:-2], capacity, stored.shape[-1])
        grown[..., : stored.shape[-2], :] = stored
        return grown

    def get_seq_length(self) -> int:  # the keys a forward finds cached: the longest row's committed ones
        return max(self.plan.host_lengths)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]


class RaggedCache:
    """The plan a batch's target cache follows after the prefill: per row, its length (the prompt's padded width,
    then its committed tokens); per forward, where each row's slots are written and the 4-D mask that lets slot i
    of row r see the row's real keys up to its own position. Masked keys past a row's length hold stale slots.
    With a `capacity` the storage is static (allocated once, every forward sees all of it: fixed shapes)."""

    def __init__(self, prompt_mask: torch.Tensor, padded: bool, single: bool, capacity: int | None = None):
        self.key_valid = prompt_mask  # (rows, prompt width): the prompt's padding is never attended to
        self.padded = padded  # whether any prompt of the call is padded (plain decoding then passes a mask)
        self.single = single  # one unpadded row: its mask is plain decoding's
        self.capacity = capacity
        self.static = capacity is not None
        self.lengths = torch.full((prompt_mask.shape[0],), prompt_mask.shape[1], device=prompt_mask.device)
        self.host_lengths = [prompt_mask.shape[1]] * prompt_mask.shape[0]
        self.end = prompt_mask.shape[1]
        self.appends = False  # whether the planned forward's layers append (`prepare`)
        self.write_index = self.lengths[:, None]
        self.row_index = torch.arange(prompt_mask.shape[0], device=prompt_mask.device)[:, None]

    @classmethod
    def convert(
        cls, cache: Any, prompt_mask: torch.Tensor, padded: bool, single: bool, capacity: int | None = None
    ) -> RaggedCache:
        """Turn the layers of a prefilled Transformers cache into `RaggedLayer`s following one plan (static ones
        of `capacity` slots, if given)."""
        plan = cls(prompt_mask, padded, single, capacity)
        size = (lambda stored: RaggedLayer._grown(stored, capacity)) if capacity else (lambda stored: stored)
        cache.layers = [RaggedLayer(size(layer.keys), size(layer.values), plan) for layer in cache.layers]
        cache.layer_class_to_replicate = None  # every layer is there: however the cache was built, it is alike
        plan.cache = cache
        return plan

    def prepare(self, slots: int) -> torch.Tensor:
        """Plan a forward of `slots` slots a row; returns its (rows, 1, slots, end) boolean mask, or for a call of
        one unpadded row the (1, end) mask of ones plain decoding passes (so its attention takes the path plain
        decoding's does: a 4-D mask sends SDPA down another kernel, which rounds half precision differently)."""
        self.end = max(self.host_lengths) + slots
        # rows that hold as many keys as each other (one row; a batch decoding in lockstep) append (`RaggedLayer`)
        self.appends = not self.static and self.alike_long
        if self.single and self.appends:  # no write index
            return self.lengths.new_ones(1, self.end)
        offsets = torch.arange(slots, device=self.lengths.device)
        self.write_index = self.lengths[:, None] + offsets[None, :]
        keys = torch.arange(self.capacity or self.end, device=self.lengths.device)
        mask = keys[None, None, :] <= self.write_index[:, :, None]
        prompt = self.key_valid.shape[1]
        mask[:, :, :prompt] &= self.key_valid[:, None, :]
        return mask[:, None]

    @property
    def alike_long(self) -> bool:
        """Whether every row holds as many keys as the others."""
        return len(set(self.host_lengths)) == 1

    def advance(self, committed: torch.Tensor | int, host_committed: list[int]) -> None:
        """Each row keeps its first `committed` slots of the last forward."""
        self.lengths = self.lengths + committed
        self.host_lengths = [n + c for n, c in zip(self.host_lengths, host_committed, strict=True)]

    def select_rows(self, index: torch.Tensor, stay: list[int]) -> None:
        """Keep only the rows `index` (`stay` on the host)."""
        self.cache.batch_select_indices(index)
        self.key_valid, self.lengths = self.key_valid[index], self.lengths[index]
        self.row_index = self.row_index[: len(stay)]
        self.host_lengths = [self.host_lengths[r] for r in stay]


@dataclass
class _Row:
    """One row's state: its controller, its committed tokens (host), its statistics."""

    index: int
    controller: DraftController
    stats: SpeculationStats
    ids: torch.Tensor  # (1, n) the row's ids as plain generate holds them (left padding kept), on the host
    lookup: NgramLookup | None
    first_real: int  # where the prompt's left padding ends
    keep: int = 0  # drafts verified this round
    lookup_drafts: list[int] = field(default_factory=list)
    lookup_budget: LookupBudget | None = None  # how many of prompt lookup's drafts pay (against the drafter's round)


@dataclass
class Verified:
    """A target forward whose slots picked committed tokens: the processed and raw logits of its slots (rows, slots,
    V) and its outputs (whose hidden states and attentions a caller may ask for); `prefill`: the prompt's forward."""

    processed: torch.Tensor
    raw: torch.Tensor
    outputs: Any
    prefill: bool = False

    def step(self, name: str, slot: int) -> Any:
        """What plain `generate` returns under `name` for the token this forward picked at `slot` (row 0)."""
        if name == "scores":
            return self.processed[:, slot]
        if name == "logits":
            return self.raw[:, slot].float()
        if name == "hidden_states":
            states = self.outputs.hidden_states
            return states if self.prefill else tuple(h[:, slot : slot + 1] for h in states)
        attentions = self.outputs.attentions  # slot i's query attends to the keys up to its own position
        if self.prefill:
            return attentions
        return tuple(a[:, :, slot : slot + 1, : a.shape[-1] - a.shape[2] + slot + 1] for a in attentions)


class ReturnedSteps:
    """What `return_dict_in_generate` asks for besides the sequences, per committed token of a single row, laid out
    as plain `generate` returns it: processed scores, raw logits, the target's attentions and hidden states."""

    FIELDS = ("scores", "logits", "attentions", "hidden_states")

    @classmethod
    def wanted(cls, config: GenerationConfig) -> bool:
        return bool(config.return_dict_in_generate) and any(getattr(config, f"output_{f}", False) for f in cls.FIELDS)

    def __init__(self, config: GenerationConfig):
        self.steps = {name: [] for name in self.FIELDS if getattr(config, f"output_{name}", False)}

    def record(self, verified: Verified, count: int) -> None:
        for slot in range(count):
            for name, steps in self.steps.items():
                steps.append(verified.step(name, slot))

    def as_output_fields(self) -> dict[str, tuple]:
        return {name: tuple(steps) for name, steps in self.steps.items()}


class BatchedSpeculativeDecoder:
    """Runs one call (see the module docstring) with its prepared `controller` (`prepare_controller`), after checking
    that the loop serves the call (`check_batched_call`); `plain_target`: what runs plain decoding's one-token steps
    (the stock model, or for a single row the call's exact-path view, whose steps give the stock bits faster);
    `prompt_lookup`: default `drafter.prompt_lookup`; `compiled`: the target's compiled call, for the forwards after
    the prefill, over a static cache of `capacity` slots; `compiled_drafter`: the drafter's, for its block forwards
    over a static context cache as large. `run()` returns the padded sequences."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: BlockDiffusionDrafter,
        controller: DraftController,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        streamer: Any,
        model_kwargs: dict[str, Any],
        plain_target: PreTrainedModel | None = None,
        prompt_lookup: bool | None = None,
        compiled: Callable[..., Any] | None = None,
        capacity: int | None = None,
        compiled_drafter: Callable[..., Any] | None = None,
    ):
        mask = model_kwargs.get("attention_mask")
        self.prompt_mask = (torch.ones_like(input_ids) if mask is None else mask).to(torch.long)
        host_ids, host_mask = input_ids.cpu(), self.prompt_mask.cpu()  # once per call (counted below)
        self.padded = not bool(host_mask.all())
        self.single = input_ids.shape[0] == 1 and not self.padded  # one unpadded row: decoded as plain decodes one
        check_batched_call(target, drafter, generation_config, stopping_criteria, streamer, model_kwargs, self.single)
        # the guard judges the batch as a whole (its rounds are shared); each row gets its own copy of the rest
        guard, per_row = (
            (controller.for_request(), controller.inner)
            if isinstance(controller, SpeculationGuard)
            else (None, controller)
        )
        controllers = [per_row.for_request() for _ in range(input_ids.shape[0])]
        if guard is not None and len(controllers) == 1:  # a single request is judged by its own controller's τ
            guard.judge_by(controllers[0])
        batch_cost = controller.cost_model.for_batch(input_ids.shape[0])
        for each in controllers if guard is None else [guard, *controllers]:
            each.use_cost_model(batch_cost)
        wants_states = bool(generation_config.output_hidden_states) or compiled is not None  # compiled: one graph
        self.hidden_states_to_keep = hidden_states_to_keep(drafter, controller, wants_states)
        prompt_lookup = drafter.prompt_lookup if prompt_lookup is None else bool(prompt_lookup)
        self.target, self.drafter = target, drafter
        self.compiled = compiled  # the target's compiled call: every forward after the prefill, in fixed shapes
        self.capacity = capacity  # its static cache's slots (`static_capacity`)
        self.plain_target = target if plain_target is None else plain_target
        self.streamer = streamer
        self.guard = guard
        self.device = input_ids.device
        self.config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = request_temperature(generation_config)
        self.processors = logits_processor
        self.row_free_processors = all(isinstance(p, ROW_FREE_PROCESSORS) for p in logits_processor)
        self.eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos_ids = set() if self.eos is None else set(self.eos.view(-1).tolist())
        pad = getattr(generation_config, "_pad_token_tensor", None)
        self.pad_token_id = int(pad) if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.stop_strings = [c for c in stopping_criteria if isinstance(c, StopStringCriteria)]
        self.deadlines = [c for c in stopping_criteria if isinstance(c, MaxTimeCriteria)]
        self.custom_criteria = [c for c in stopping_criteria if not isinstance(c, HANDLED_CRITERIA)]
        self.max_length = generation_config.max_length
        self.cache_name = cache_argument(target)
        self.cache = _target_cache(target, model_kwargs)
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.head_weight, self.head_bias = drafter.draft_head(self.lm_head)
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.input_ids = input_ids
        self.rows: list[_Row] = []
        for i, controller in enumerate(controllers):
            first_real = int(host_mask[i].argmax()) if bool(host_mask[i].any()) else input_ids.shape[1]
            stats = SpeculationStats(
                prompt_tokens=input_ids.shape[1] - first_real,
                controller=(guard or controller).describe(),  # the guard's description names what it wraps
                cost_model_source=controller.cost_model.source if controller.cost_model else "",
            )
            lookup = NgramLookup() if prompt_lookup else None
            self.rows.append(_Row(i, controller, stats, host_ids[i : i + 1], lookup, first_real))
        self.returned = ReturnedSteps(generation_config) if ReturnedSteps.wanted(generation_config) else None
        self.stats = BatchSpeculationStats(
            rows=[row.stats for row in self.rows],
            batch_size=len(self.rows),
            cost_model_source=self.rows[0].stats.cost_model_source,
            host_syncs=1,
        )
        self.finished: list[torch.Tensor] = [torch.empty(0)] * len(self.rows)
        self.plan: RaggedCache | None = None  # the cache's layout, from the prefill on
        self.positions = self.prompt_mask.cumsum(-1) - 1  # as plain generate: positions count real tokens only
        self.compiled_drafter = compiled_drafter
        self.draft_cache = (
            DraftContextCache()
            if compiled_drafter is None
            else StaticDraftContextCache(len(self.rows), capacity, drafter.device)
        )
        self.context_valid = self.prompt_mask.new_zeros(len(self.rows), 0, dtype=torch.bool)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (hidden, valid, positions)
        self.shared_drafted: int | None = None  # the shared width the batch drafted last (`_batch_width`)
        drafter.last_stats = self.call_stats

    # ------------------------------------------------------------------------------------------- the loop
    @property
    def call_stats(self) -> SpeculationStats | BatchSpeculationStats:
        """The call's statistics: one request's `SpeculationStats`, or a batch's `BatchSpeculationStats`."""
        return self.stats.rows[0] if self.stats.batch_size == 1 else self.stats

    @torch.no_grad()
    def run(self) -> torch.LongTensor:
        if self.streamer is not None:  # the prompt first, as plain generate streams it
            self.streamer.put(self.input_ids.cpu())
        prompt_mask = self.prompt_mask
        prefill = self._forward(self.input_ids, self.positions.masked_fill(prompt_mask == 0, 0), prompt_mask, 1)
        self._keep_context(prefill, prompt_mask.bool(), self.positions)
        self.next_position = self.positions[:, -1] + 1
        self.plan = RaggedCache.convert(self.cache, prompt_mask.bool(), self.padded, self.single, self.capacity)
        for i, row in enumerate(self.rows):
            row.controller.start(self._row_prefill(prefill, i, row.first_real), self.lm_head, self.temperature)
            row.stats.policy_seconds = row.controller.policy_seconds
            row.stats.policy_probs = row.controller.policy_probs
            row.stats.target_forwards = 1
            row.stats.widths_per_round.append(1)
        # a single row drafts its own controller's width, as its policy chose and its rounds correct it
        self.shared_width = len(self.rows) > 1 and all(row.controller.tau_curve() is not None for row in self.rows)
        width, gain = self._batch_width()
        pays = gain is None or gain >= 1 + self._drafting_margin()
        self.batch_plain = self.shared_width and not pays  # with no guard to judge it, as a single request's policy
        if self.guard is not None:
            self.guard.begin(self.temperature, width if pays else 1)
        # decided once: a batch none of whose rows drafts again decodes plain, keeping no drafter context
        self.plain = self.batch_plain or not self._may_draft_again()
        if self.plain:
            self.pending = []
        # a drafting row weighs prompt lookup's drafts against its drafter's round; a single plain row, against steps
        for row in self.rows if not self.plain or self.single else []:
            if row.lookup is not None and row.controller.cost_model is not None:
                row.lookup_budget = LookupBudget(row.controller.cost_model, self.temperature)
        for row in self.rows:
            row.stats.block_size = 1 if self.plain else (width if self.shared_width else row.controller.width())
        raw = prefill.logits[:, -1:]
        logits = self._process(raw.float())
        first = self._pick(logits)[:, 0]
        self.anchor = first
        host = self._to_host(first).tolist()
        self._commit([[t] for t in host], [0] * len(self.rows), Verified(logits, raw, prefill, prefill=True))
        step = self._plain_round if self.plain else self._round
        while self.rows:
            step()
        if self.streamer is not None:
            self.streamer.end()
        return self._sequences()

    def _may_draft_again(self) -> bool:
        """Whether any row may still draft (no row does where the guard decided on plain decoding)."""
        if self.guard is not None and self.guard.max_width() <= 1:
            return False
        return any(row.controller.max_width() > 1 for row in self.rows)

    def _batch_width(self) -> tuple[int, float | None]:
        """The width the batch drafts next, and its predicted speedup over plain batched steps: where every row's
        controller predicts τ per width (`tau_curve`), the one `fastest_width` for the slowest row at the batch's
        size, growing from the width drafted last as a single request's does; else each row drafts its own width,
        and the widest is returned with no prediction (`None`)."""
        if not self.shared_width:
            return max(row.controller.width() for row in self.rows), None
        curves = [row.controller.tau_curve() for row in self.rows]
        return fastest_width(curves, self.rows[0].controller.cost_model, self.temperature, self.shared_drafted)

    def _drafting_margin(self) -> float:
        """The predicted gain the rows' policies need before drafting: the largest `TauEvidence.margin`."""
        evidence = [row.controller.evidence for row in self.rows]
        return max([MIN_PREDICTED_GAIN, *(each.margin for each in evidence if each is not None)])

    def _round(self, drafted: tuple[torch.Tensor | None, torch.Tensor | None, list[int]] | None = None) -> None:
        """One speculative round: `drafted` (drafts, their draft logits, how many each row verifies), else this
        round's own (`_draft`), verified in one target forward and committed."""
        drafts, draft_logits, keeps = drafted or self._draft()
        widest = max(keeps)
        slots = torch.arange(widest + 1, device=self.device)
        keep = torch.tensor(keeps, device=self.device)
        valid = slots[None, :] <= keep[:, None]
        block = self.anchor[:, None] if widest == 0 else torch.cat([self.anchor[:, None], drafts[:, :widest]], dim=1)
        block = block.masked_fill(~valid, self.pad_token_id)
        positions = self.next_position[:, None] + slots[None, :]
        outputs = self._verify(block, positions, [k + 1 for k in keeps], keep_states=not self.plain)
        self.stats.verify_slots += len(self.rows) * (widest + 1)
        self.stats.padded_slots += sum(widest - k for k in keeps)
        raw = outputs.logits[:, : widest + 1]
        logits = self._process(raw.float(), block)
        accepted, tokens = self._accept(block[:, 1:], None if widest == 0 else draft_logits[:, :widest], logits, keep)
        self.next_position = self.next_position + accepted + 1
        host = self._to_host(torch.cat([accepted[:, None], tokens], dim=1)).tolist()
        if not self.plain:
            # a single row keeps only its committed tokens' states, so its drafter runs unmasked, as drafted alone
            kept_slots = host[0][0] + 1 if self.single else widest + 1
            kept = slots[None, :kept_slots] <= accepted[:, None]
            self._keep_context(outputs, kept, positions[:, :kept_slots])
        if self.guard is not None and not self.plain:  # the batch's round, as the mean row's, at its widest
            width = max(row.stats.widths_per_round[-1] for row in self.rows)
            self.guard.observe(sum(keeps) / len(keeps), sum(n for n, *_ in host) / len(host), width)
        # a row's rejected drafts and padding lie past its new length: the next round writes over them
        self.plan.advance(accepted + 1, [n + 1 for n, *_ in host])
        self.anchor = tokens.gather(1, accepted[:, None])[:, 0]
        self._commit([toks[: n + 1] for n, *toks in host], [n for n, *_ in host], Verified(logits, raw, outputs))

    def _accept(
        self, drafts: torch.Tensor, draft_logits: torch.Tensor | None, logits: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the drafts accepted among its first `keep` and the (rows, slots) tokens whose first accepted + 1
        are committed: greedy, the target's argmax; sampling, speculative sampling against `draft_logits` (the
        processed logits the drafts were drawn from; None when no row drafted)."""
        if draft_logits is None:
            return torch.zeros_like(keep), self._pick(logits)
        if self.do_sample:
            return _speculative_sampling(drafts, draft_logits, logits, keep)
        return _greedy_acceptance(drafts, logits.argmax(dim=-1), keep)

    def _plain_round(self) -> None:
        """One plain decoding step for a batch whose rows never draft again: one token a row, as plain `generate`
        decodes it, with no drafter context kept (so the target returns no hidden states the call did not ask for).
        A single row with prompt lookup verifies its looked-up drafts instead where they pay (`_looked_up`)."""
        for row in self.rows:
            row.keep = 0
            row.stats.widths_per_round.append(1)
        if self.rows[0].lookup_budget is not None and self._looked_up():
            keep = self.rows[0].keep
            self._round((*self._select(None, keep + 1), [keep]))
            return
        block = self.anchor[:, None]
        rows = len(self.rows)
        outputs = self._verify(block, self.next_position[:, None], [1] * rows, keep_states=False)
        self.stats.verify_slots += rows
        raw = outputs.logits[:, :1]
        logits = self._process(raw.float(), block)
        self.anchor = self._pick(logits)[:, 0]
        self.next_position = self.next_position + 1
        host = self._to_host(self.anchor).tolist()
        self.plan.advance(1, [1] * rows)
        self._commit([[t] for t in host], [0] * rows, Verified(logits, raw, outputs))

    # ------------------------------------------------------------------------------------------ drafting
    def _draft(self) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
        """This round's drafts (rows, slots) and their draft logits, and per row how many go to the target."""
        widths, budgets = [], []
        drafting = self.guard is None or self.guard.width() > 1  # the guard may pause the whole batch
        drafting = drafting and not self.batch_plain
        shared = self._batch_width()[0] if drafting and self.shared_width else None
        self.shared_drafted = shared or self.shared_drafted
        for row in self.rows:
            room = self.max_length - row.ids.shape[1]
            width = min((shared or row.controller.width()) if drafting else 1, room + 1)
            budgets.append(max(min(width - 1, room - 1), 0))
            widths.append(width if budgets[-1] > 0 else 1)
            looked = (
                row.lookup.continuation(row.ids[:, row.first_real :], budgets[-1])
                if row.lookup is not None and budgets[-1] > 0
                else []
            )
            if looked and row.lookup_budget is not None:  # only as many as pay, and only if they beat the drafter
                rival = self._drafter_rate(row, width)
                looked = looked[: row.lookup_budget.drafts(len(looked), row.lookup.matched, rival)]
            row.lookup_drafts = looked
        drafting = [w if not row.lookup_drafts else 1 for w, row in zip(widths, self.rows, strict=True)]
        if max(budgets) == 0:
            for row in self.rows:
                row.keep = 0
                row.stats.widths_per_round.append(1)
            return None, None, [0] * len(self.rows)
        width = max(max(drafting), max(len(row.lookup_drafts) for row in self.rows) + 1)
        logits = None
        if max(drafting) > 1:
            logits = self._drafter_logits(drafting, width)
        else:
            self._extend_draft_context()
        drafts, draft_logits = self._select(logits, width)
        drafted = self._drafted_rounds(logits, budgets)
        keeps = []
        for row, round_, w in zip(self.rows, drafted, widths, strict=True):
            start = time.perf_counter()
            row.keep = min(max(row.controller.num_to_verify(round_), 0), round_.num_drafts) if round_.num_drafts else 0
            row.stats.controller_seconds += time.perf_counter() - start
            row.stats.widths_per_round.append(w)
            if row.lookup_drafts:
                row.stats.lookup_rounds += 1
            keeps.append(row.keep)
        return drafts, draft_logits, keeps

    def _drafter_rate(self, row: _Row, width: int) -> float | None:
        """Tokens per ms the row's controller expects of a drafter round of `width` slots (its corrected τ under
        its cost model), where it predicts τ; else `None`."""
        curve = row.controller.tau_curve()
        if not curve or width not in curve or row.controller.cost_model is None:
            return None
        return curve[width] / max(row.controller.cost_model.round_ms(width, self.temperature), 1e-9)

    def _looked_up(self) -> bool:
        """Whether the single row, decoding plain with prompt lookup on, verifies looked-up drafts this round:
        those that pay (`LookupBudget`), with no drafter forward, become its `lookup_drafts` and `keep`."""
        row = self.rows[0]
        room = self.max_length - row.ids.shape[1]
        looked = row.lookup.continuation(row.ids, min(row.lookup_budget.most, room - 1)) if room > 1 else []
        row.keep = row.lookup_budget.drafts(len(looked), row.lookup.matched)
        row.lookup_drafts = looked[: row.keep]
        row.stats.lookup_rounds += row.keep > 0
        return row.keep > 0

    def _drafter_logits(self, widths: list[int], width: int) -> torch.Tensor:
        """One drafter forward over every active row's block (a row's slots past its own width masked out):
        (rows, width - 1, V) full-vocabulary float logits of slots 1..width-1."""
        hidden, positions = self._take_pending()
        rows = len(self.rows)
        block_ids = torch.full((rows, width), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, 0] = self.anchor
        block_positions = self.next_position[:, None] + torch.arange(width, device=self.device)[None, :]
        if self.compiled_drafter is not None:  # the context taken in eagerly, the block forward in fixed shapes
            self.drafter.extend_context(hidden, positions, self.draft_cache)
            hidden, positions = hidden.new_zeros(rows, 0, hidden.shape[-1]), positions.new_zeros(rows, 0)
        mask = None  # one unpadded row sees all its context and slots: the drafter's own masks (its causal layers)
        if not self.single:
            slot_visible = (
                torch.arange(width, device=self.device)[None, :] < torch.tensor(widths, device=self.device)[:, None]
            )
            context = self.context_valid if self.compiled_drafter is None else self.draft_cache.filled
            visible = torch.cat([context, slot_visible], dim=1)
            mask = visible[:, None, None, :].expand(rows, 1, width, visible.shape[1])
        out = (
            (self.compiled_drafter or self.drafter)(
                block_embeds=self.drafter.embed_block(self.embed_tokens, block_ids).to(self.drafter.device),
                block_position_ids=block_positions,
                target_hidden=hidden,
                context_position_ids=positions,
                attention_mask=mask,
                cache=self.draft_cache,
            )
            .last_hidden_state[:, 1:]
            .contiguous()
        )  # a strided bfloat16 input sends F.linear down a slow path
        self.stats.drafter_forwards += 1
        for row in self.rows:
            row.stats.drafter_forwards += 1
        self.draft_hidden = out
        logits = self.drafter.head_logits(out, self.head_weight, self.head_bias)
        return self.drafter.full_vocabulary(logits, self.vocab_size)

    def _extend_draft_context(self) -> None:
        """Rounds drafted by prompt lookup alone: the drafter only takes in the new context."""
        hidden, positions = self._take_pending()
        self.drafter.extend_context(hidden, positions, self.draft_cache)

    def _select(self, logits: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: its drafts (prompt lookup's, else picked from the drafter's processed logits) and the
        processed logits they were drawn from (one-hot for lookup drafts). (rows, width - 1) and (rows, width - 1, V).
        """
        rows = len(self.rows)
        if logits is None:
            logits = torch.zeros(rows, width - 1, self.vocab_size, device=self.device)
        selector = self.drafter.candidate_selector
        if selector is None and self.row_free_processors:
            processed = self._process(logits)
            drafts = self._pick(processed)
        else:  # drafts depend on the ones before them: picked left to right, row by row
            drafts = torch.empty(rows, width - 1, dtype=torch.long, device=self.device)
            processed = torch.empty_like(logits)
            for r, row in enumerate(self.rows):
                score = None
                if selector is not None and not row.lookup_drafts:
                    score = selector.scorer(self.draft_hidden[r : r + 1], logits[r : r + 1])
                ids = row.ids.to(self.device)  # ends with the anchor
                for i in range(width - 1):
                    raw = logits[r : r + 1, i] if score is None else score(i, ids[:, -1])
                    processed[r : r + 1, i] = self.processors(ids, raw) if self.processors else raw
                    drafts[r, i] = self._pick(processed[r : r + 1, i : i + 1])[0, 0]
                    ids = torch.cat([ids, drafts[r : r + 1, i : i + 1]], dim=1)
        for r, row in enumerate(self.rows):
            if row.lookup_drafts:
                looked = torch.tensor(row.lookup_drafts, dtype=torch.long, device=self.device)
                n = looked.shape[0]
                drafts[r, :n] = looked
                processed[r, :n] = torch.full_like(processed[r, :n], float("-inf")).scatter_(-1, looked[:, None], 0.0)
        return drafts, processed

    def _drafted_rounds(self, raw: torch.Tensor | None, budgets: list[int]) -> list[DraftedRound]:
        """What each row's controller sees of its drafts: per-slot confidence and entropy from the drafter's raw
        logits (before processors and any draw, so they never depend on which tokens were drafted), in one host
        transfer, if any row's controller reads them."""
        rounds = []
        confidence = entropy = None
        if raw is not None and any(row.controller.reads_confidence for row in self.rows):
            probs = torch.softmax(raw / self.temperature if self.temperature > 0 else raw, dim=-1)
            both = self._to_host(torch.stack([probs.amax(dim=-1), torch.special.entr(probs).sum(dim=-1)]))
            confidence, entropy = both[0], both[1]
        for r, (row, budget) in enumerate(zip(self.rows, budgets, strict=True)):
            if row.lookup_drafts:
                rounds.append(DraftedRound(min(len(row.lookup_drafts), budget), lookup=True))
            elif confidence is None or not row.controller.reads_confidence or budget == 0:
                rounds.append(DraftedRound(budget))
            else:
                rounds.append(DraftedRound(budget, confidence=confidence[r, :budget], entropy=entropy[r, :budget]))
        return rounds

    # --------------------------------------------------------------------------------------- verifying
    def _verify(self, block: torch.Tensor, positions: torch.Tensor, slots: list[int], keep_states: bool = True) -> Any:
        """The target forward over each row's next `block` (rows, n) at `positions`, after the prefill, row r's
        first `slots[r]` real."""
        if self.compiled is not None:  # compiled graphs guard on strides too: always a fresh, contiguous block
            block = block.clone(memory_format=torch.contiguous_format)
        with slot_key_lengths(self.plan.host_lengths, slots, self.plan.padded):
            mask = self.plan.prepare(block.shape[1])
            return self._forward(block, positions, mask, block.shape[1], keep_states, self.compiled)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        keep_logits: int,
        keep_states: bool = True,
        compiled: Callable[..., Any] | None = None,
    ) -> Any:
        """One target forward; `keep_states`: return the hidden states the drafter reads (the call's own request
        for them is always served). Plain steps that return no hidden states or attentions, of a single row or of a
        batch in lockstep (`_in_lockstep`), are plain decoding's own forwards, so `plain_target` runs them; the rest
        run the view, where the hooks Transformers attaches to capture outputs stay; or `compiled`."""
        wanted = keep_states or self.config.output_hidden_states or compiled is not None  # compiled: one graph a shape
        states = self.hidden_states_to_keep if wanted else False
        attentions = {"output_attentions": True} if self.config.output_attentions else {}
        stock = ids.shape[1] == 1 and not states and not attentions and (self.single or self._in_lockstep())
        model = compiled or (self.plain_target if stock else self.target)
        outputs = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=states,
            logits_to_keep=keep_logits,
            **attentions,
            **{self.cache_name: self.cache},
        )
        self.stats.target_forwards += 1
        for row in self.rows:
            row.stats.target_forwards += 1
        return outputs

    def _in_lockstep(self) -> bool:
        """Whether every row is still in the batch and holds as many keys as the others: a one-token step is then
        exactly plain batched decoding's (after a row leaves, the view pads products, `_as_plain_steps`)."""
        plan = self.plan
        return plan is not None and len(self.rows) == self.stats.batch_size and plan.alike_long

    def _process(self, logits: torch.Tensor, block: torch.Tensor | None = None) -> torch.Tensor:
        """The logits processors on (rows, slots, V) logits: at once where they read only the scores, else row by
        row and slot by slot with the ids before each slot (as plain generate's processors see them); `block`:
        the verified block, whose slot 0 is each row's last committed token."""
        if not self.processors:
            return logits
        rows, slots, vocab = logits.shape
        if self.row_free_processors:
            ids = self.input_ids[:1].expand(rows * slots, -1)
            return self.processors(ids, logits.reshape(rows * slots, vocab)).view(rows, slots, vocab)
        out = torch.empty_like(logits)
        for r, row in enumerate(self.rows):
            ids = row.ids.to(self.device)
            for i in range(slots):
                prefix = ids if block is None else torch.cat([ids, block[r : r + 1, 1 : i + 1]], dim=1)
                out[r, i] = self.processors(prefix, logits[r : r + 1, i])[0]
        return out

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, k, V) logits -> (rows, k) tokens: argmax, or one draw from softmax(logits) per position at T > 0;
        a non-finite distribution is a clear error (checked only when the draw fails: no host sync otherwise)."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.flatten(0, 1), dim=-1)
        try:
            return torch.multinomial(probs, num_samples=1).view(logits.shape[:2])
        except RuntimeError as error:
            if bool(torch.isfinite(probs).all()):
                raise
            raise ValueError(
                "the draft distribution is not finite (NaN/inf logits): the drafter's weights are damaged or it "
                "overflowed in this dtype; reload the drafter, or run it in float32"
            ) from error

    # -------------------------------------------------------------------------------------- bookkeeping
    def _keep_context(self, outputs: Any, kept: torch.Tensor, positions: torch.Tensor) -> None:
        """The target states of the tokens just verified (at the drafter's layers), kept for the drafter's next
        forward; `kept` (rows, slots) marks the committed ones (the last committed token is the next anchor and
        joins next round, as slot 0)."""
        hidden_states = outputs.hidden_states
        slots = kept.shape[1]
        hidden = torch.cat([hidden_states[i + 1][:, :slots] for i in self.drafter.target_layer_ids], dim=-1)
        self.pending.append((hidden.to(self.drafter.device), kept, positions))

    def _take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept target states (rows, n, ·) and their positions, for the drafter to take in; the rows' context
        mask grows by them (unless one unpadded row, which sees all its context)."""
        hidden, valid, positions = (torch.cat(parts, dim=1) for parts in zip(*self.pending, strict=True))
        self.pending = []
        if self.compiled_drafter is not None:
            self.draft_cache.place(positions, valid)
        elif not self.single:
            self.context_valid = torch.cat([self.context_valid, valid], dim=1)
        return hidden, positions.masked_fill(~valid, 0)

    def _commit(self, committed: list[list[int]], accepted: list[int], verified: Verified) -> None:
        """Append each row's committed tokens (cut at its first stop; `verified`: the forward that picked them),
        stream and record them, record the row's round, retire finished rows."""
        done = []
        timed_out = any(bool(c(None, None)) for c in self.deadlines) if self.deadlines else False
        for r, (row, tokens) in enumerate(zip(self.rows, committed, strict=True)):
            cut, stop = self._cut_at_stop(row, tokens, verified.processed[r])
            new = torch.tensor([cut], dtype=row.ids.dtype)
            row.ids = torch.cat([row.ids, new], dim=1)
            if self.streamer is not None:
                self.streamer.put(new[0])
            if self.returned is not None:
                self.returned.record(verified, len(cut))
            row.stats.new_tokens = row.ids.shape[1] - self.input_ids.shape[1]
            row.stats.drafted_per_round.append(row.keep)
            row.stats.accepted_per_round.append(min(accepted[r], len(cut) - 1))
            if row.lookup_drafts:  # a lookup round: what the drafter's controller expects is not in question
                if row.lookup_budget is not None:
                    row.lookup_budget.observe(row.keep, accepted[r])
            else:
                row.controller.observe(row.keep, accepted[r])
            if stop or timed_out or row.ids.shape[1] >= self.max_length:
                done.append(r)
        if done:
            self._retire(done)

    def _cut_at_stop(self, row: _Row, tokens: list[int], scores: torch.Tensor) -> tuple[list[int], bool]:
        """`tokens` up to and including the first that ends the row (EOS, a stop string, a custom stopping
        criterion, which sees the ids so far and the processed `scores` the token was picked from; max length)."""
        room = self.max_length - row.ids.shape[1]
        for i, token in enumerate(tokens[:room]):
            if token in self.eos_ids:
                return tokens[: i + 1], True
            if self.stop_strings or self.custom_criteria:
                ids = torch.cat([row.ids, torch.tensor([tokens[: i + 1]], dtype=row.ids.dtype)], dim=1)
                if any(bool(c(ids, None)[0]) for c in self.stop_strings) or any(
                    bool(c(ids.to(self.device), scores[i : i + 1])[0]) for c in self.custom_criteria
                ):
                    return tokens[: i + 1], True
        return tokens[:room], len(tokens) > room

    def _retire(self, done: list[int]) -> None:
        """Finished rows leave the batch: their cache rows, masks and pending context are dropped."""
        for r in done:
            row = self.rows[r]
            self.finished[row.index] = row.ids[0]
        stay = [r for r in range(len(self.rows)) if r not in set(done)]
        self.rows = [self.rows[r] for r in stay]
        if not stay:
            return
        index = torch.tensor(stay, device=self.device)
        self.plan.select_rows(index, stay)
        self.draft_cache.select_rows(index.to(self.drafter.device))
        self.context_valid = self.context_valid[index]
        self.next_position = self.next_position[index]
        self.anchor = self.anchor[index]
        self.pending = [tuple(t[index] for t in part) for part in self.pending]

    def _sequences(self) -> torch.LongTensor:
        longest = max(ids.shape[0] for ids in self.finished)
        out = torch.full((len(self.finished), longest), self.pad_token_id, dtype=torch.long)
        for i, ids in enumerate(self.finished):
            out[i, : ids.shape[0]] = ids
        return out.to(self.device)

    def _row_prefill(self, outputs: Any, r: int, first_real: int) -> Any:
        """Row r's prefill outputs without its left padding: what a batch-1 call's controller reads."""
        states = tuple(None if h is None else h[r : r + 1, first_real:] for h in outputs.hidden_states)
        return SimpleNamespace(hidden_states=states, logits=outputs.logits[r : r + 1])

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The loop's only device-to-host transfers (counted: one per round, one more for confidences)."""
        self.stats.host_syncs += 1
        return tensor.cpu()


def static_capacity(max_length: int, max_width: int) -> int:
    """Slots of a compiled call's static target cache: the longest row and the widest block past it, rounded up
    to a multiple of `CAPACITY_STEP` so that prompts of similar lengths share compiled graphs."""
    return -(-(max_length + max_width) // CAPACITY_STEP) * CAPACITY_STEP


def _greedy_acceptance(
    drafts: torch.Tensor, target_tokens: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: drafts accepted (leading matches among its first `keep` drafts) and the tokens to commit
    (the target's own tokens, which equal the accepted drafts)."""
    slots = torch.arange(drafts.shape[1], device=drafts.device)
    match = (drafts == target_tokens[:, :-1]) & (slots[None, :] < keep[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_tokens


def _speculative_sampling(
    drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling per row over its first `keep` drafts (Leviathan et al. 2023, Algorithm 1): draft i
    is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a token is drawn from
    norm(max(p - q, 0)), after all of them the bonus from p. Returns accepted counts and (rows, k + 1) tokens
    whose first accepted + 1 are the ones to commit."""
    rows, k = drafts.shape
    slots = torch.arange(k + 1, device=drafts.device)
    p = torch.softmax(target_logits, dim=-1)
    q = torch.softmax(draft_logits, dim=-1)
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    accept = (torch.rand_like(p_draft) * q_draft <= p_draft) & (slots[None, :k] < keep[:, None])
    accepted = accept.long().cumprod(dim=1).sum(dim=1)
    at = accepted[:, None, None].expand(rows, 1, p.shape[-1])
    p_at = p.gather(1, at)[:, 0]
    q_padded = torch.cat([q, q.new_zeros(rows, 1, q.shape[-1])], dim=1)
    rejected = (accepted < keep)[:, None]
    q_at = torch.where(rejected, q_padded.gather(1, at)[:, 0], torch.zeros_like(p_at))
    residual = (p_at - q_at).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    final = torch.multinomial(residual / residual.sum(-1, keepdim=True), num_samples=1)[:, 0]
    tokens = torch.cat([drafts, drafts.new_zeros(rows, 1)], dim=1)
    tokens = torch.where(slots[None, :] == accepted[:, None], final[:, None], tokens)
    return accepted, tokens
