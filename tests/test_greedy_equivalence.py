"""Greedy output with the block-diffusion assistant is token-identical to plain `generate`."""

from __future__ import annotations

import random

import torch
from conftest import (
    ScriptedDrafter,
    default_where_drafting_pays,
    greedy_generate,
    make_drafter,
    make_target,
    make_windowed_drafter,
)

from hf_blockpilot import AdaptiveVerify
from hf_blockpilot.costs import CostModel

VOCAB, HIDDEN = 48, 64  # vocab <= hidden lets ScriptedDrafter invert the LM head exactly


def test_greedy_identical_over_randomized_cases():
    targets = {fam: make_target(fam, vocab_size=VOCAB, hidden_size=HIDDEN, seed=1) for fam in ("llama", "qwen3")}
    saw_full_block = saw_partial = saw_eos_in_block = False
    cases = 64
    for case in range(cases):
        rng = random.Random(case)
        family = rng.choice(sorted(targets))
        target = targets[family]
        prompt_len = rng.randint(1, 64)
        block_size = rng.randint(2, 32)
        max_new = rng.randint(1, 64)
        prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(case))
        eos = None
        if rng.random() < 0.4:  # stop on a token the plain output produces, so EOS lands inside a block
            free = greedy_generate(target, prompt, max_new, None)[0, prompt_len:]
            eos = int(free[rng.randrange(free.numel())])
        expected = greedy_generate(target, prompt, max_new, eos)

        draft_vocab = None
        if rng.random() < 0.25:
            draft_vocab = sorted(rng.sample(range(VOCAB), VOCAB // 2))
        scripted = rng.random() < 0.6
        torch.manual_seed(case)
        cls = ScriptedDrafter if scripted else type(make_drafter(target))
        drafter = cls.from_target(target, block_size=block_size, draft_vocab=draft_vocab).eval()
        if scripted:
            drafter.rig(target, expected, error_rate=rng.choice([0.0, 0.05, 0.2, 0.5]), seed=case)

        controller = default_where_drafting_pays(drafter)
        got = greedy_generate(target, prompt, max_new, eos, assistant_model=drafter, draft_controller=controller)
        msg = (
            f"case {case}: {family} prompt={prompt_len} b={block_size} max_new={max_new} eos={eos} scripted={scripted}"
        )
        assert torch.equal(got, expected), msg

        stats = drafter.last_stats
        assert stats.block_size == block_size, msg  # decided right after the prefill
        assert stats.new_tokens == expected.shape[1] - prompt_len, msg
        assert stats.target_forwards == len(stats.accepted_per_round) == len(stats.drafted_per_round), msg
        assert stats.new_tokens == sum(a + 1 for a in stats.accepted_per_round), msg
        for drafted, accepted in zip(stats.drafted_per_round, stats.accepted_per_round):
            assert 0 <= accepted <= drafted <= block_size - 1, msg
            saw_full_block |= drafted == block_size - 1 and accepted == drafted
            saw_partial |= 0 < accepted < drafted
        if eos is not None and scripted and expected[0, -1] == eos and stats.tau > 1.5:
            saw_eos_in_block = True
    assert saw_full_block, "no round accepted a whole block: the often-right drafter is not exercised"
    assert saw_partial, "no round accepted part of a block"
    assert saw_eos_in_block, "no case stopped at EOS while drafting whole blocks"


def test_scripted_drafter_reaches_full_acceptance(family):
    """A drafter that is always right commits b tokens per verify forward."""
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=2)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    expected = greedy_generate(target, prompt, 40, None)
    drafter = ScriptedDrafter.from_target(target, block_size=5).eval().rig(target, expected, error_rate=0.0)
    got = greedy_generate(target, prompt, 40, None, assistant_model=drafter)
    assert torch.equal(got, expected)
    stats = drafter.last_stats
    # prefill commits 1 token, then each verify round commits 4 drafts + 1 bonus (the last round may be capped)
    assert stats.accepted_per_round[1:-1] == [4] * (len(stats.accepted_per_round) - 2)
    assert stats.tau > 4.0
    assert stats.acceptance_length > 4.5


def test_block_size_setter_and_other_sizes(family):
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=3)
    drafter = make_drafter(target, block_size=16)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = greedy_generate(target, prompt, 20, None)
    for block_size in (2, 3, 7, 16, 40):
        drafter.block_size = block_size
        controller = default_where_drafting_pays(drafter)
        got = greedy_generate(target, prompt, 20, None, assistant_model=drafter, draft_controller=controller)
        assert torch.equal(got, expected)
        assert drafter.last_stats.block_size == block_size
        assert max(drafter.last_stats.drafted_per_round) == min(
            block_size - 1, 20 - 2
        )  # prefill commits 1, one slot stays for the bonus


def test_sliding_window_drafter_with_prompt_lookup_policy_and_controller(built_decoders):
    """A drafter with a causal sliding-window layer (window 3) and a full one, over contexts far longer than the
    window: identical to plain `generate`, with and without prompt lookup, under a
    policy and under the per-round controller; its context cache dropped what the window no longer reaches."""
    from test_policy import make_policy

    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, seed=1)
    drafter = make_windowed_drafter(
        target, 3, ["sliding_attention", "full_attention"], num_hidden_layers=2, block_size=6, scale=6.0
    )
    cost = CostModel(target_ms={1: 10.0, 16: 14.0}, drafter_ms={16: 1.0})
    drafted = lookups = 0
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
        expected = greedy_generate(target, prompt, 90, None)
        for control in ("block size", "policy", "controller"):
            for lookup in (False, True):
                drafter.prompt_lookup = lookup
                drafter.set_policy(
                    make_policy(target, drafter, (3, 6), prompt_lookup=lookup) if control == "policy" else None
                )
                controller = AdaptiveVerify(6, cost_model=cost) if control == "controller" else None
                got = greedy_generate(target, prompt, 90, None, assistant_model=drafter, draft_controller=controller)
                assert torch.equal(got, expected), (seed, control, lookup)
                cache = built_decoders[-1].draft_cache
                assert cache._dropped[0] > 0 and cache._dropped[1] == 0  # only the sliding layer drops
                drafted += sum(drafter.last_stats.drafted_per_round)
                lookups += drafter.last_stats.lookup_rounds
    drafter.set_policy(None)
    assert drafted > 100 and lookups > 0
