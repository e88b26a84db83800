"""Sampling with the block-diffusion assistant draws from exactly the target's (warped) distribution.

The exact joint law of the first sampled tokens is computed by enumerating every continuation of a tiny-vocab
target; `generate(..., assistant_model=drafter, do_sample=True)` samples are checked against it with a
chi-square goodness-of-fit test. The same test must reject a deliberately broken generator whose drafts are
not drawn from the logits it hands to the speculative-sampling step.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import make_drafter, make_sharp_target

import hf_blockpilot.custom_generate as custom_generate_module
from hf_blockpilot import BlockDiffusionDrafter, DraftController
from hf_blockpilot.batched import BatchedSpeculativeDecoder
from hf_blockpilot.controllers import DraftedRound

VOCAB = 4
NUM_TOKENS = 3  # joint law of the first 3 sampled tokens: VOCAB**3 cells
# 4 new tokens: after the prefill token, one verify round drafts 2 tokens (positions 2 and 3 of the joint),
# so the joint covers a chained accept/reject of two drafts; the 4th token is the round's bonus.
MAX_NEW_TOKENS = 4
NUM_SAMPLES = 5000
# The broken generator is off by chi2 ~ 1000 per 1000 samples (critical value ~88): fewer samples keep the file fast.
BROKEN_SAMPLES = 2000
PROMPT = torch.tensor([[1, 2, 3, 1, 2]])
Z_999 = 3.090232306167813  # standard normal quantile at 1 - 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (here at p = 0.001)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, cells with expected count < 5 pooled together."""
    n = counts.sum().item()
    expected = (probs.double() * n).tolist()
    observed = counts.double().tolist()
    order = sorted(range(len(expected)), key=lambda i: expected[i])
    pooled_e = pooled_o = 0.0
    cells: list[tuple[float, float]] = []
    for i in order:
        # pool small cells; keep pooling while the pool is still too small
        if expected[i] < 5 or (0 < pooled_e < 5):
            pooled_e += expected[i]
            pooled_o += observed[i]
        else:
            cells.append((observed[i], expected[i]))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    # observations in zero-probability cells are caught by the pooled cell (or make it infinite)
    stat = sum((o - e) ** 2 / e if e > 0 else (math.inf if o > 0 else 0.0) for o, e in cells)
    return stat, len(cells) - 1


def _warp(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None = None, min_p: float | None = None
) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p, as generate() orders its warpers (each keeps at least the most
    likely token); returns probabilities."""
    logits = logits.double() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None:  # drop the least likely tokens whose total probability is at most 1 - top_p
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    if min_p is not None:  # drop tokens less likely than min_p times the most likely one
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    return logits.softmax(-1)


@torch.no_grad()
def exact_joint(
    target,
    prompt: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """P(first NUM_TOKENS tokens = c) for every continuation c, index sum(c_i * VOCAB**(n-1-i))."""
    conts = torch.tensor(list(itertools.product(range(VOCAB), repeat=NUM_TOKENS)))
    seqs = torch.cat([prompt.expand(conts.shape[0], -1), conts], dim=1)
    logits = target(seqs).logits[:, prompt.shape[1] - 1 : prompt.shape[1] - 1 + NUM_TOKENS]
    probs = _warp(logits, temperature, top_k, top_p, min_p)  # (cells, NUM_TOKENS, VOCAB)
    joint = probs.gather(-1, conts.unsqueeze(-1)).squeeze(-1).prod(-1)
    assert torch.allclose(joint.sum(), torch.tensor(1.0, dtype=joint.dtype))
    return joint


def draw(target, drafter, n: int, temperature: float, top_k: int | None, top_p: float | None = None, **kwargs):
    """`n` assisted samples: counts per cell, plus drafted/accepted/prompt-lookup-round totals over all runs."""
    counts = torch.zeros(VOCAB**NUM_TOKENS, dtype=torch.long)
    drafted = accepted = lookups = 0
    weights = torch.tensor([VOCAB ** (NUM_TOKENS - 1 - i) for i in range(NUM_TOKENS)])
    start = PROMPT.shape[1]
    torch.manual_seed(1234)
    for _ in range(n):
        out = target.generate(
            PROMPT,
            assistant_model=drafter,
            do_sample=True,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
        assert out.shape[1] == start + MAX_NEW_TOKENS
        counts[int((out[0, start : start + NUM_TOKENS] * weights).sum())] += 1
        drafted += sum(drafter.last_stats.drafted_per_round)
        accepted += sum(drafter.last_stats.accepted_per_round)
        lookups += drafter.last_stats.lookup_rounds
    return counts, drafted, accepted, lookups


@pytest.fixture(scope="module")
def target():
    return make_sharp_target(VOCAB)


def _check_drafter_differs(target, drafter):
    """q must clearly differ from p, or a draft-distribution bug could hide."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True)
        ctx = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1)
        block = torch.full((1, 3), drafter.mask_token_id)
        block[0, 0] = int(torch.multinomial(out.logits[0, -1].softmax(-1), 1, generator=gen))
        hidden = drafter(
            block_embeds=target.get_input_embeddings()(block),
            block_position_ids=torch.arange(5, 8)[None],
            target_hidden=ctx,
            context_position_ids=torch.arange(5)[None],
        ).last_hidden_state
        q = target.lm_head(hidden)[0, 1].softmax(-1)
    assert q.max() > 0.4, f"drafter is nearly uniform ({q}): sharpen it"


CONFIGS = {
    # T=1, no top-k/top-p: no logits processor at all, drafts drawn from raw drafter logits
    "t1_no_processors": dict(temperature=1.0, top_k=None),
    # temperature + top-k: drafts drawn position by position from processed logits
    "t07_topk3": dict(temperature=0.7, top_k=3),
    # the nucleus and min-p warpers after the temperature: cut tokens differ per position
    "t09_topp_minp": dict(temperature=0.9, top_k=None, top_p=0.9, min_p=0.08),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sampling_matches_exact_distribution(target, built_decoders, config):
    kwargs = CONFIGS[config]
    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    _check_drafter_differs(target, drafter)
    counts, drafted, accepted, _ = draw(target, drafter, NUM_SAMPLES, **kwargs)

    decoder = built_decoders[-1]
    if kwargs == CONFIGS["t1_no_processors"]:
        assert len(decoder.processors) == 0, decoder.processors
    else:
        assert len(decoder.processors) >= 2, decoder.processors
        joint = exact_joint(target, PROMPT, **kwargs)
        assert (joint == 0).sum() > (
            exact_joint(target, PROMPT, temperature=kwargs["temperature"], top_k=None) == 0
        ).sum()

    assert accepted > 0.1 * NUM_SAMPLES, "drafts were (almost) never accepted: the test would be vacuous"
    assert accepted < drafted, "drafts were never rejected: the residual resampling is not exercised"
    stat, df = chi_square(counts, exact_joint(target, PROMPT, **kwargs))
    print(f"{config}: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}")
    assert df >= 10
    assert stat < chi2_critical(df), f"{config}: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_sampling_exact_with_reduced_draft_vocab(target):
    torch.manual_seed(2)
    drafter = BlockDiffusionDrafter.from_target(target, block_size=3, draft_vocab=[0, 2, 3]).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(8.0)
    _check_drafter_differs(target, drafter)
    counts, drafted, accepted, _ = draw(target, drafter, NUM_SAMPLES, temperature=1.0, top_k=None)
    assert accepted > 0.1 * NUM_SAMPLES and accepted < drafted
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    print(f"reduced vocab: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}")
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_sampling_exact_with_prompt_lookup(target):
    """Rounds drafted by prompt lookup (one-hot draft distribution) mixed with drafter rounds stay exact."""
    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    drafter.prompt_lookup = True
    counts, drafted, accepted, lookups = draw(target, drafter, NUM_SAMPLES, temperature=1.0, top_k=None)
    # PROMPT ends with (1, 2), which occurred before: whenever the prefill samples 3, (1, 2, 3) is copied
    assert 0.05 * NUM_SAMPLES < lookups < 0.95 * NUM_SAMPLES, lookups
    assert accepted > 0.1 * NUM_SAMPLES and accepted < drafted
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    print(f"prompt lookup: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} lookups={lookups} accepted={accepted}")
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


class ArgmaxDraftsDecoder(BatchedSpeculativeDecoder):
    """BROKEN on purpose: drafts are the argmax although sampling, so they are not drawn from the verified logits."""

    def _select(self, logits, width):
        drafts, processed = super()._select(logits, width)
        return processed.argmax(dim=-1), processed


def test_chi_square_rejects_broken_generator(target, monkeypatch, built_decoders):
    monkeypatch.setattr(custom_generate_module, "BatchedSpeculativeDecoder", ArgmaxDraftsDecoder)
    kwargs = CONFIGS["t1_no_processors"]
    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)  # the drafter of the passing T=1 run
    counts, drafted, accepted, _ = draw(target, drafter, BROKEN_SAMPLES, **kwargs)
    assert isinstance(built_decoders[-1], ArgmaxDraftsDecoder)  # the broken decoder really ran
    assert accepted > 0
    stat, df = chi_square(counts, exact_joint(target, PROMPT, **kwargs))
    print(f"broken: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}")
    assert stat > chi2_critical(df), f"broken generator passed: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_chi_square_helpers():
    # Wilson–Hilferty vs tabulated chi-square 0.999 quantiles
    for df, table in [(10, 29.588), (30, 59.703), (60, 99.607)]:
        assert abs(chi2_critical(df) - table) / table < 0.01
    probs = torch.tensor([0.5, 0.3, 0.1995, 0.0005])
    stat, df = chi_square(torch.tensor([500, 300, 200, 0]), probs)
    assert df == 2 and stat < 0.01  # the tiny cell is pooled with the smallest big one
    stat, _ = chi_square(torch.tensor([600, 200, 200, 0]), probs)
    assert stat > chi2_critical(2)


class ConfidenceThreshold(DraftController):
    """Verify the leading drafts whose draft distribution's top probability is at least `threshold` (reads
    only the distributions, as every shipped controller does); records the confidences it saw."""

    reads_confidence = True

    def __init__(self, threshold: float, block_size: int = 4):
        super().__init__(block_size)
        self.threshold = threshold
        self.seen: list[float] = []
        self.kept: list[int] = []

    def for_request(self):
        return self  # one shared record over all draws (the test's own bookkeeping)

    def num_to_verify(self, drafted: DraftedRound) -> int:
        self.seen += drafted.confidence.tolist()
        below = (drafted.confidence < self.threshold).tolist() + [True]
        self.kept.append(below.index(True))
        return self.kept[-1]


class PeekingDecoder(BatchedSpeculativeDecoder):
    """BROKEN on purpose: after drawing the drafts it verifies only the prefix of argmax drafts, so whether a
    position carries a draft depends on the draft drawn there (the mistake a controller must never make)."""

    def _draft(self):
        drafts, processed, keeps = super()._draft()
        if drafts is None:
            return drafts, processed, keeps
        for r, row in enumerate(self.rows):
            is_top = (drafts[r] == processed[r].argmax(-1)).tolist() + [False]
            row.keep = keeps[r] = min(keeps[r], is_top.index(False))
        return drafts, processed, keeps


def test_sampling_exact_with_a_truncating_controller(target):
    """A controller that cuts the block per round from the draft distributions keeps sampling exact."""
    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    probe = ConfidenceThreshold(threshold=2.0)
    draw(target, drafter, 200, temperature=1.0, top_k=None, draft_controller=probe)
    controller = ConfidenceThreshold(threshold=sorted(probe.seen)[len(probe.seen) // 2])  # cuts about half the slots
    counts, drafted, accepted, _ = draw(
        target, drafter, NUM_SAMPLES, temperature=1.0, top_k=None, draft_controller=controller
    )
    rounds = controller.kept
    assert 0.1 < sum(k < 2 for k in rounds) / len(rounds) < 0.9, "the controller never (or always) truncated"
    assert accepted > 0.1 * NUM_SAMPLES and accepted < drafted
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    print(f"controller: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}")
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_chi_square_rejects_truncation_that_peeks_at_the_drafts(target, monkeypatch, built_decoders):
    monkeypatch.setattr(custom_generate_module, "BatchedSpeculativeDecoder", PeekingDecoder)
    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    counts, drafted, accepted, _ = draw(target, drafter, BROKEN_SAMPLES, temperature=1.0, top_k=None)
    assert isinstance(built_decoders[-1], PeekingDecoder)
    assert accepted > 0
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    print(f"peeking: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}")
    assert stat > chi2_critical(df), f"peeking generator passed: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_sampling_exact_when_the_guard_pauses_after_a_losing_round(target):
    """The guard decides the next round's width from the last round's outcome (a rejected round pauses
    drafting, so the third token's mechanism depends on the second's acceptance): still the target's law."""
    from hf_blockpilot import CostModel, SpeculationGuard

    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    # a round committing one token loses to a plain step (12 ms for 1 token vs 10 ms), two or more win
    costs = CostModel(target_ms={1: 10.0, 4: 10.0}, drafter_ms={2: 2.0, 4: 2.0})
    guard = SpeculationGuard(DraftController(4), probe_rounds=1, decay=0.0, first_pause=1, timing="modeled")
    guard.use_cost_model(costs)
    paused = []
    for seed in range(40):
        torch.manual_seed(seed)
        target.generate(
            PROMPT,
            assistant_model=drafter,
            do_sample=True,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=0,
            draft_controller=guard,
        )
        paused.append(drafter.last_stats.plain_rounds > 0)
    assert 0 < sum(paused) < len(paused), "the guard never (or always) paused: the test would not exercise it"
    counts, drafted, accepted, _ = draw(
        target, drafter, NUM_SAMPLES, temperature=1.0, top_k=None, draft_controller=guard
    )
    assert accepted > 0.1 * NUM_SAMPLES
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_sampling_exact_with_lookup_alone(target):
    """A request that decodes plain (its drafter cannot pay) verifying prompt lookup's drafts where they pay
    (`LookupBudget`, whose count follows the request's own lookup acceptance): still the target's law."""
    from hf_blockpilot import CostModel, SpeculationGuard

    drafter = make_drafter(target, seed=3, block_size=4, scale=8.0)
    drafter.prompt_lookup = True
    costs = CostModel(target_ms={1: 10.0, 4: 10.5}, drafter_ms={2: 500.0, 4: 500.0})  # verifies cheap, drafter dear
    guard = SpeculationGuard(DraftController(4))
    guard.use_cost_model(costs)
    counts, drafted, accepted, lookups = draw(
        target, drafter, NUM_SAMPLES, temperature=1.0, top_k=None, draft_controller=guard
    )
    assert 0.05 * NUM_SAMPLES < lookups and 0 < accepted < drafted, (lookups, accepted, drafted)
    stat, df = chi_square(counts, exact_joint(target, PROMPT, temperature=1.0, top_k=None))
    print(f"lookup alone: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} lookups={lookups} accepted={accepted}")
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"
