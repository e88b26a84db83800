"""The decoding loop replayed along a known continuation, with the drafter alone running: the oracle's labels.

The target is causal, so one forward over prompt + continuation holds every hidden state and next token any verify
round along that continuation would see. `ReplayTarget` answers the loop's target forwards from it (hidden states
at the forward's positions; logits whose argmax is the continuation's next token), so `generate`'s own loop
(`hf_blockpilot.batched`) runs with its own drafting, controller and bookkeeping, and only the target's compute is
skipped. `ExpectedRoundsDecoder` instead commits exactly one token per round and hands each round's draft
distributions to a callback, for acceptance taken in expectation (`oracle.expected_sampled_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..batched import BatchedSpeculativeDecoder
from ..controllers import DraftController
from ..custom_generate import prepare_controller
from ..modeling_block_diffusion import BlockDiffusionDrafter
from .calibration import RoundRecorder


class ReplayTarget:
    """Stands in for the target in the decoding loop: forwards are answered from `hidden_states` (the target's
    `hidden_states` tuple over `sequence`, (1, n) prompt + continuation), and each slot's logits are one-hot at
    the continuation's next token (its last token past the end)."""

    def __init__(self, target: PreTrainedModel, hidden_states: Sequence[torch.Tensor], sequence: torch.LongTensor):
        self.target, self.hidden_states, self.sequence = target, tuple(hidden_states), sequence
        self.vocab_size = target.get_output_embeddings().weight.shape[0]

    def get_input_embeddings(self) -> Any:
        return self.target.get_input_embeddings()

    def get_output_embeddings(self) -> Any:
        return self.target.get_output_embeddings()

    def forward(
        self,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        logits_to_keep: int = 1,
        output_hidden_states: bool | list[int] = False,
        cache: Any = None,
        **kwargs: Any,
    ) -> SimpleNamespace:
        positions = position_ids[0]
        last = self.sequence.shape[1] - 1
        states = tuple(h[:, positions.clamp(max=last)] for h in self.hidden_states) if output_hidden_states else None
        following = self.sequence[0, (positions[-logits_to_keep:] + 1).clamp(max=last)]
        logits = torch.zeros(1, following.shape[0], self.vocab_size, device=following.device)
        logits[0, torch.arange(following.shape[0]), following] = 1.0
        return SimpleNamespace(logits=logits, hidden_states=states)

    __call__ = forward


#: `on_round(committed_length, width, draft_logits)`: a round's processed draft distributions of the drafts sent to
#: the verifier, (k, V) -> the probability each is accepted given the ones before it were.
RoundCallback = Callable[[int, int, torch.Tensor], Sequence[float]]


class ExpectedRoundsDecoder(BatchedSpeculativeDecoder):
    """The loop drafting at every committed length of a replayed continuation: each round commits exactly the
    continuation's next token, after `on_round` has weighed the round's drafts (a `RoundRecorder` controller
    records that expected acceptance)."""

    on_round: RoundCallback

    def _accept(self, drafts, draft_logits, logits, keep):
        row = self.rows[0]
        kept = draft_logits[0, : int(keep[0])] if draft_logits is not None else logits[0, :0]
        acceptance = self.on_round(row.ids.shape[1], row.stats.widths_per_round[-1], kept)
        if isinstance(row.controller, RoundRecorder):
            row.controller.record_expected(acceptance)
        return torch.zeros_like(keep), logits.argmax(dim=-1)


class _EmptyCache:
    """The replay keeps no keys or values."""

    layers: list = []

    def get_seq_length(self) -> int:
        return 0


def replay_decoder(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    hidden_states: Sequence[torch.Tensor],
    sequence: torch.LongTensor,
    prompt_len: int,
    controller: DraftController | int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    processors: LogitsProcessorList | None = None,
    on_round: RoundCallback | None = None,
) -> BatchedSpeculativeDecoder:
    """The decoder `generate` would run for `sequence[:, :prompt_len]` with `controller` (sampling with `processors`
    if given, else greedy), replayed along `sequence` (`ReplayTarget`); with `on_round`, an `ExpectedRoundsDecoder`.
    Costs are the real target's (`prepare_controller`)."""
    prompt = sequence[:, :prompt_len]
    config = GenerationConfig(max_length=prompt_len + max_new_tokens, do_sample=processors is not None)
    config._eos_token_tensor = torch.tensor(list(eos_token_ids), device=prompt.device) if eos_token_ids else None
    prepared = prepare_controller(target, drafter, controller)
    decoder_class = BatchedSpeculativeDecoder if on_round is None else ExpectedRoundsDecoder
    decoder = decoder_class(
        ReplayTarget(target, hidden_states, sequence),
        drafter,
        prepared,
        prompt,
        config,
        processors or LogitsProcessorList(),
        [],
        None,
        {"cache": _EmptyCache()},
    )
    if on_round is not None:
        decoder.on_round = on_round
    return decoder
