"""Randomized soak: many small greedy cases across targets, drafters (DFlash and DFlash 2), block sizes,
controllers, generate options and prompt lookup, all identical to plain `generate`; and repeated calls leak
neither memory nor hooks."""

from __future__ import annotations

import gc
import random
import time
import warnings

import pytest
import torch
from conftest import ScriptedDrafter, make_dflash2_drafter, make_drafter, make_target

from hf_blockpilot import AdaptiveVerify, DraftController
from hf_blockpilot.costs import CostModel
from hf_blockpilot.tools.baselines import AcceptanceEMA, EntropyStop, HeuristicSchedule

VOCAB, HIDDEN = 40, 48
CASES = 1000
TIME_LIMIT_S = 600  # a bound for CI on 2 cores; the cases take about a minute there

OPTIONS = [
    {},
    {"repetition_penalty": 1.3},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 6},
    {"suppress_tokens": [5, 6, 7]},
    {"bad_words_ids": [[8], [9, 10]]},
    {"sequence_bias": {(11,): 4.0}},
    {"begin_suppress_tokens": [12]},
]


def _controller(rng: random.Random, block_size: int):
    cost = CostModel(target_ms={1: 10.0, 16: 10.0 + rng.uniform(0, 30)}, drafter_ms={16: 1.0})
    return rng.choice(
        [
            lambda: None,
            lambda: block_size,
            lambda: DraftController(block_size),
            lambda: AdaptiveVerify(block_size, cost_model=cost),
            lambda: EntropyStop(block_size, gamma=rng.uniform(0.1, 1.0), threshold=rng.uniform(0.2, 0.8)),
            lambda: HeuristicSchedule(2, block_size),
            lambda: AcceptanceEMA(block_size),
        ]
    )()


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints:UserWarning")  # min_new_tokens > room, on purpose
def test_soak_greedy_equality():
    start = time.perf_counter()
    targets = [
        make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, layers=2, seed=seed)
        for family in ("llama", "qwen3")
        for seed in (0, 1)
    ]
    mismatches, lookups, drafted = [], 0, 0
    for case in range(CASES):
        rng = random.Random(50_000 + case)
        target = rng.choice(targets)
        block_size = rng.randint(2, 12)
        prompt = torch.randint(3, VOCAB, (1, rng.randint(1, 20)), generator=torch.Generator().manual_seed(case))
        if rng.random() < 0.3:
            prompt = torch.cat([prompt, prompt], dim=1)  # something for prompt lookup to copy
        options = dict(rng.choice(OPTIONS))
        eos = rng.choice([None, None, rng.randrange(3, VOCAB)])
        common = dict(max_new_tokens=rng.randint(1, 20), do_sample=False, eos_token_id=eos, pad_token_id=0, **options)
        expected = target.generate(prompt, **common)
        kind = rng.random()
        if kind < 0.5:
            drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
            drafter.rig(
                target,
                expected,
                error_rate=rng.choice([0.0, 0.2, 0.5]),
                seed=case,
                varied_confidence=rng.random() < 0.5,
            )
        elif kind < 0.85:
            drafter = make_drafter(target, seed=case, block_size=block_size, scale=rng.choice([1.0, 6.0]))
        else:  # DFlash 2: convolutions and a candidate selector
            drafter = make_dflash2_drafter(
                target,
                seed=case,
                block_size=block_size,
                conv_kernel_size=rng.choice([2, 3, 4]),
                selector_top_k=rng.choice([1, 3, 8]),
            )
        drafter.prompt_lookup = rng.random() < 0.3
        controller = _controller(rng, block_size)
        got = target.generate(prompt, assistant_model=drafter, draft_controller=controller, **common)
        if not torch.equal(got, expected):
            mismatches.append((case, options, controller and getattr(controller, "name", controller)))
        lookups += drafter.last_stats.lookup_rounds
        drafted += sum(drafter.last_stats.drafted_per_round)
        assert time.perf_counter() - start < TIME_LIMIT_S, f"soak over its time bound after {case} cases"
    assert not mismatches, mismatches[:10]
    assert lookups > 50 and drafted > 5 * CASES  # lookup rounds and real drafting both exercised


def _hook_count(*models: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for model in models
        for m in model.modules()
    )


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # some torch objects warn when their type is probed
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_repeated_calls_leak_neither_memory_nor_hooks():
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=2, seed=3)
    drafter = make_drafter(target, block_size=6, scale=4.0)
    prompt = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    attention = target.config._attn_implementation
    controller = AdaptiveVerify(6, cost_model=CostModel(target_ms={1: 10.0, 6: 20.0}, drafter_ms={6: 1.0}))

    def run(n: int) -> None:
        for _ in range(n):
            target.generate(
                prompt,
                assistant_model=drafter,
                draft_controller=controller,
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )

    run(5)  # warm-up: lazily built caches and Transformers' output-capturing hooks (installed once)
    hooks = _hook_count(target, drafter)
    tensors_before = _live_tensors()
    run(40)
    tensors_after = _live_tensors()
    assert tensors_after - tensors_before <= 5, (tensors_before, tensors_after)
    assert _hook_count(target, drafter) == hooks
    assert target.config._attn_implementation == attention
