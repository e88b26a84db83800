"""Prompt lookup: n-gram continuation drafts, mixed with drafter rounds, keep decoding lossless."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import greedy_generate, make_drafter, make_target

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.controllers import DraftController, LookupBudget, SpeculationGuard
from hf_blockpilot.costs import CostModel
from hf_blockpilot.modeling_block_diffusion import DraftContextCache
from hf_blockpilot.prompt_lookup import NgramLookup

VOCAB, HIDDEN = 48, 64


def _ids(tokens: list[int]) -> torch.LongTensor:
    return torch.tensor([tokens])


def _brute_force(tokens: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Reference: scan every earlier position for the longest tail n-gram, most recent occurrence first."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + max_tokens]
    return []


def test_lookup_prefers_longest_then_most_recent_match():
    lookup = NgramLookup(max_ngram=3, min_ngram=2)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # the 3-gram (5, 6, 7) occurred at 0..2, followed by 8; the 2-gram (6, 7) more recently, followed by 9
    assert lookup.continuation(_ids(tokens), 3) == [8, 1, 6] and lookup.matched == 3
    bigrams = NgramLookup(max_ngram=2, min_ngram=2)
    assert bigrams.continuation(_ids(tokens), 3) == [9, 5, 6] and bigrams.matched == 2
    assert lookup.continuation(_ids([*tokens, 4]), 3) == [] and lookup.matched == 0  # no earlier (7, 4)
    assert NgramLookup().continuation(_ids([1, 2, 3, 4]), 5) == []  # no earlier occurrence of the tail
    assert NgramLookup().continuation(_ids([3, 3]), 4) == []  # the tail itself is never its own match
    assert NgramLookup().continuation(_ids([3, 3, 3]), 4) == [3]  # (3, 3) at 0..1, followed by one token


def test_incremental_index_equals_brute_force():
    rng = random.Random(0)
    for case in range(20):
        lookup = NgramLookup()
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        while len(tokens) < 80:
            max_tokens = rng.randint(1, 8)
            assert lookup.continuation(_ids(tokens), max_tokens) == _brute_force(tokens, max_tokens, 4, 2), case
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 5))]


def test_lookup_rejects_bad_ngram_sizes():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramLookup(max_ngram=2, min_ngram=3)


def test_prompt_lookup_setting_is_validated():
    drafter = make_drafter(make_target(vocab_size=VOCAB, hidden_size=HIDDEN))
    assert drafter.prompt_lookup is False  # off by default: plain DFlash drafting
    drafter.prompt_lookup = True
    assert drafter.prompt_lookup is True
    with pytest.raises(ValueError, match="True or False"):
        drafter.prompt_lookup = 1


def test_extend_context_caches_what_a_forward_would(family):
    """A cache filled by `extend_context` drafts exactly like a cache-less forward over the whole context."""
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=3)
    drafter = make_drafter(target, seed=4, block_size=4)
    width = len(drafter.target_layer_ids) * HIDDEN
    hidden = torch.randn(1, 9, width)
    block = torch.randn(1, 4, HIDDEN)
    with torch.no_grad():
        reference = drafter(
            block_embeds=block,
            block_position_ids=torch.arange(9, 13)[None],
            target_hidden=hidden,
            context_position_ids=torch.arange(9)[None],
        ).last_hidden_state
        cache = DraftContextCache()
        drafter.extend_context(hidden[:, :5], torch.arange(5)[None], cache)
        drafter.extend_context(hidden[:, 5:7], torch.arange(5, 7)[None], cache)
        assert cache.get_seq_length() == 7
        cached = drafter(
            block_embeds=block,
            block_position_ids=torch.arange(9, 13)[None],
            target_hidden=hidden[:, 7:],
            context_position_ids=torch.arange(7, 9)[None],
            cache=cache,
        ).last_hidden_state
    torch.testing.assert_close(cached, reference)


def test_greedy_identical_with_prompt_lookup():
    """Repetitive prompts make lookup rounds frequent; output stays identical to plain greedy decoding."""
    targets = {fam: make_target(fam, vocab_size=VOCAB, hidden_size=HIDDEN, seed=1) for fam in ("llama", "qwen3")}
    lookup_rounds = drafter_rounds = accepted_total = 0
    for case in range(24):
        rng = random.Random(case)
        target = targets[rng.choice(sorted(targets))]
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
        prompt = _ids((motif * 8)[: rng.randint(4, 40)])
        max_new = rng.randint(1, 48)
        eos = None
        expected = greedy_generate(target, prompt, max_new, None)
        if rng.random() < 0.4:  # an EOS the plain output produces, so it can land inside a copied block
            eos = int(expected[0, rng.randrange(prompt.shape[1], expected.shape[1])])
            expected = greedy_generate(target, prompt, max_new, eos)
        block_size = rng.randint(2, 12)
        draft_vocab = sorted(rng.sample(range(VOCAB), VOCAB // 2)) if rng.random() < 0.3 else None
        torch.manual_seed(case)
        drafter = BlockDiffusionDrafter.from_target(target, block_size=block_size, draft_vocab=draft_vocab).eval()
        drafter.prompt_lookup = True
        # every round drafts (no guard to pause a losing drafter on this machine's timing): both kinds of round
        got = greedy_generate(target, prompt, max_new, eos, assistant_model=drafter, draft_controller=block_size)
        msg = f"case {case}: prompt={prompt.tolist()} b={block_size} max_new={max_new} eos={eos}"
        assert torch.equal(got, expected), msg
        stats = drafter.last_stats
        assert stats.new_tokens == sum(a + 1 for a in stats.accepted_per_round), msg
        for drafted, accepted in zip(stats.drafted_per_round, stats.accepted_per_round):
            assert 0 <= accepted <= drafted <= block_size - 1, msg
        drafted_rounds = sum(1 for d in stats.drafted_per_round if d > 0)
        assert stats.lookup_rounds + stats.drafter_forwards == drafted_rounds, msg
        lookup_rounds += stats.lookup_rounds
        drafter_rounds += stats.drafter_forwards
        accepted_total += sum(stats.accepted_per_round)
    assert lookup_rounds > 20 and drafter_rounds > 20, "both kinds of round must be exercised"
    assert accepted_total > 0


def test_prompt_lookup_copies_a_repeating_answer():
    """When the target repeats itself, lookup rounds commit several tokens where a random drafter commits ~1."""
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, seed=1)
    prompt = _ids([5, 9, 13, 5, 9])
    expected = greedy_generate(target, prompt, 64, None)
    drafter = make_drafter(target, seed=0, block_size=6)
    every_round = dict(assistant_model=drafter, draft_controller=6)  # no guard pausing the random drafter
    plain_drafting = greedy_generate(target, prompt, 64, None, **every_round)
    tau_without = drafter.last_stats.tau
    drafter.prompt_lookup = True
    with_lookup = greedy_generate(target, prompt, 64, None, **every_round)
    assert torch.equal(plain_drafting, expected) and torch.equal(with_lookup, expected)
    # a random tiny model falls into a loop within 64 greedy tokens, which lookup copies
    assert drafter.last_stats.lookup_rounds > 0
    assert drafter.last_stats.tau > tau_without + 0.5, (drafter.last_stats.tau, tau_without)


def _guarded(cost: CostModel) -> SpeculationGuard:
    guard = SpeculationGuard(DraftController(4))
    guard.use_cost_model(cost)
    return guard


def test_a_request_decoding_plain_still_verifies_lookup_drafts_that_pay():
    """Where the drafter cannot pay (the guard decides on plain decoding) but a verify costs little more than a
    plain step, prompt lookup's drafts are still verified, as many as pay (`LookupBudget`), with no drafter
    forward; greedy output stays plain decoding's. Where verifies are dear, every step is plain."""
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, seed=1)
    prompt = _ids([5, 9, 13, 5, 9])
    expected = greedy_generate(target, prompt, 64, None)
    drafter = make_drafter(target, seed=0, block_size=6)
    drafter.prompt_lookup = True
    dear_drafter = CostModel(target_ms={1: 10.0, 2: 10.5, 8: 12.0}, drafter_ms={2: 500.0, 8: 500.0})
    got = greedy_generate(target, prompt, 64, None, assistant_model=drafter, draft_controller=_guarded(dear_drafter))
    stats = drafter.last_stats
    assert torch.equal(got, expected)
    assert stats.drafter_forwards == 0 and stats.lookup_rounds > 0 and stats.tau > 1.5
    assert set(stats.widths_per_round) == {1} and max(stats.drafted_per_round) > 1  # several drafts, no drafter
    assert stats.plain_rounds == sum(1 for d in stats.drafted_per_round[1:] if d == 0) < len(stats.drafted_per_round)
    dear_verify = CostModel(target_ms={1: 10.0, 2: 30.0, 8: 120.0}, drafter_ms={2: 500.0, 8: 500.0})
    got = greedy_generate(target, prompt, 64, None, assistant_model=drafter, draft_controller=_guarded(dear_verify))
    assert torch.equal(got, expected) and drafter.last_stats.lookup_rounds == 0 and drafter.last_stats.tau == 1.0


def test_the_lookup_budget_follows_the_costs_the_match_and_the_request_s_own_acceptance():
    cheap = CostModel(target_ms={1: 10.0, 2: 10.5, 9: 10.5}, drafter_ms={})
    budget = LookupBudget(cheap, temperature=0.0)
    assert budget.drafts(0, 4) == 0 and budget.drafts(3, 2) == 3 and budget.drafts(100, 4) == budget.most
    assert budget.drafts(8, 0) == 0 and budget.drafts(8, 1) == 0  # no match (or none the priors know): plain
    assert LookupBudget(CostModel(target_ms={1: 10.0, 2: 20.0}, drafter_ms={}), 0.0).drafts(8, 4) == 0  # never pays
    zen3 = LookupBudget(CostModel(target_ms={1: 10.0, 2: 15.5, 4: 22.0, 8: 39.0}, drafter_ms={}), 0.0)
    # a 2-token verify at 1.55 plain steps: a draft after a 2-token match (accepted half the time) does not pay,
    # drafts after a 4-token match do
    assert zen3.drafts(8, 2) == 0 and zen3.drafts(8, 4) >= 1 and zen3.drafts(8, 6) == zen3.drafts(8, 4)
    rejected = 0
    while zen3.drafts(8, 4) and rejected < 20:  # every looked-up draft rejected: the request's evidence turns it off
        zen3.observe(zen3.drafts(8, 4), 0)
        rejected += 1
    assert zen3.drafts(8, 4) == 0 and 2 <= rejected < 20  # not on the first rejection, but within a few
    fresh = LookupBudget(zen3.cost_model, 0.0)
    assert zen3.evidence[2].acceptance == fresh.evidence[2].acceptance  # the evidence is kept per match length
    assert zen3.drafts(8, 3) == 0 and fresh.drafts(8, 3) == fresh.drafts(8, 4)  # 3 tokens or more: one class


def test_looked_up_drafts_replace_a_drafter_round_only_where_they_beat_it():
    budget = LookupBudget(CostModel(target_ms={1: 10.0, 2: 10.5, 9: 10.5}, drafter_ms={}), temperature=0.0)
    best = budget.drafts(8, 4)
    tau = budget.evidence[3].current()[best + 1]  # matches of 3 tokens or more: one class
    rate = tau / budget.cost_model.modeled_round_ms(1, best, 0.0)  # tokens per ms of the best lookup round
    assert budget.drafts(8, 4, rival_rate=0.9 * rate) == best  # a slower drafter round: the lookup round
    assert budget.drafts(8, 4, rival_rate=1.1 * rate) == 0  # a faster one: the drafter drafts
