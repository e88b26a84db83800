"""The guard around the default controller: never slower than plain decoding on the device's costs."""

from __future__ import annotations

import pytest
import torch
from conftest import ScriptedDrafter, greedy_generate, make_drafter, make_target

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.controllers import (
    PAUSE_MARGIN,
    AdaptiveVerify,
    DraftController,
    SpeculationGuard,
    TauEvidence,
)
from hf_blockpilot.costs import CostModel
from hf_blockpilot.modeling_block_diffusion import DraftContextCache

VOCAB = 61
# a verify of up to 8 tokens costs one plain step; the drafter a fifth of one
FLAT = CostModel(target_ms={1: 10.0, 8: 10.0}, drafter_ms={2: 2.0, 8: 2.0})
# every multi-token verify costs three plain steps: no acceptance can pay for drafting
STEEP = CostModel(target_ms={1: 10.0, 2: 30.0, 8: 30.0}, drafter_ms={2: 5.0, 8: 5.0})


def pair(seed: int = 3) -> tuple[torch.nn.Module, BlockDiffusionDrafter, torch.Tensor]:
    target = make_target("llama", vocab_size=VOCAB, hidden_size=64, seed=seed)
    drafter = make_drafter(target, block_size=6, seed=seed)  # random: its drafts are mostly rejected
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))
    return target, drafter, prompt


def guarded(cost: CostModel, **kwargs) -> SpeculationGuard:
    """A guard on the cost model's clock that pauses at break-even (`pause_margin=0`) unless told otherwise."""
    guard = SpeculationGuard(DraftController(6), **{"timing": "modeled", "pause_margin": 0.0, **kwargs})
    guard.use_cost_model(cost)
    return guard


def test_a_request_decodes_plain_when_the_costs_say_speculation_loses():
    target, drafter, prompt = pair()
    plain = greedy_generate(target, prompt, 30, None)
    out = greedy_generate(target, prompt, 30, None, assistant_model=drafter, draft_controller=guarded(STEEP))
    stats = drafter.last_stats
    assert torch.equal(out, plain)
    assert stats.drafter_forwards == 0 and stats.block_size == 1
    assert stats.plain_rounds == len(stats.widths_per_round) - 1 and stats.new_tokens == 30


def test_the_request_check_prices_the_drafts_as_the_inner_controller_verifies_them():
    """Wide verifies that cost many plain steps (a CPU's exact bfloat16 path): a fixed width verifies every draft,
    so at the prior acceptance b = 16 cannot pay, while a controller that picks its verify count can still send
    one draft, which pays; b = 2 pays either way, and b = 16 where the controller expects τ(16) = 5."""
    cost = CostModel(target_ms={1: 20.0, 2: 24.0, 4: 34.0, 16: 90.0}, drafter_ms={2: 2.0, 16: 3.0})

    class Expecting(DraftController):  # a τ policy's controller: it expects τ(16) = 5 of this request
        name = "expecting"

        def tau_curve(self) -> dict[int, float]:
            return {16: 5.0}

    verdicts = {}
    for inner in (DraftController(16), AdaptiveVerify(16), DraftController(2), Expecting(16)):
        guard = SpeculationGuard(inner)
        guard.use_cost_model(cost)
        verdicts[f"{inner.name}-{inner.block_size}"] = guard.speculation_can_pay(inner.block_size)
    assert verdicts == {"fixed-16": False, "adaptive-16": True, "fixed-2": True, "expecting-16": True}


@pytest.mark.parametrize(("speed", "accepted", "pauses"), [(1.0, 0, True), (2.0, 0, True), (2.0, 2, False)])
def test_measured_rounds_are_judged_in_the_machine_s_own_time(speed, accepted, pauses):
    """A machine now `speed` times as fast as when its costs were measured (a plain step modeled at 10 ms, a round
    of 6 at 15 ms): a round committing one token loses to plain steps at either speed, since a plain step is then
    as much faster as the round (judged against the modeled 10 ms, the round would have looked like a win at
    twice the speed); three tokens a round win."""
    cost = CostModel(target_ms={1: 10.0, 6: 13.0}, drafter_ms={2: 2.0, 6: 2.0})
    now = [0.0]
    guard = SpeculationGuard(DraftController(6), timing="measured", clock=lambda: now[0])
    guard.use_cost_model(cost)
    guard.begin(0.0, 6)
    paused = False
    for _ in range(4):
        assert guard.width() in (1, 6)
        paused |= guard.width() == 1
        now[0] += cost.round_ms(6) / 1000 / speed
        guard.observe(5, accepted)
    assert paused == pauses


def test_drafting_pauses_below_break_even_and_probes_again_with_doubling_pauses():
    target, drafter, prompt = pair()
    plain = greedy_generate(target, prompt, 80, None)
    # the prior (every second draft accepted) says drafting pays; this drafter's rounds say it does not
    guard = guarded(FLAT, probe_rounds=2, first_pause=3, decay=0.0)
    out = greedy_generate(target, prompt, 80, None, assistant_model=drafter, draft_controller=guard)
    stats = drafter.last_stats
    assert torch.equal(out, plain)
    widths = stats.widths_per_round[1:]
    pauses, run = [], 0
    for w in widths:
        if w == 1:
            run += 1
        elif run:
            pauses.append(run)
            run = 0
    assert pauses[:3] == [3, 6, 12]  # each probe lost again: the pause doubled
    assert widths[:2] == [6, 6] and stats.drafter_forwards == sum(1 for w in widths if w > 1)
    assert stats.drafter_forwards < len(widths) // 2


def test_the_guard_judges_from_the_first_round_with_its_prior():
    """A drafter whose drafts are rejected (τ near 1) on costs where the prior says drafting pays: with the default
    settings the request falls back to plain steps within three drafting rounds, not after a probe window."""
    target, drafter, prompt = pair()
    plain = greedy_generate(target, prompt, 40, None)
    out = greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=guarded(FLAT))
    widths = drafter.last_stats.widths_per_round[1:]
    assert torch.equal(out, plain)
    assert widths[0] == 6 and 1 in widths[:4]
    drafted = [i for i, w in enumerate(widths) if w > 1]
    probes = [i for i in drafted if i > 0 and widths[i - 1] == 1]  # drafting rounds right after a pause
    assert probes and all(i + 1 >= len(widths) or widths[i + 1] == 1 for i in probes)  # each lost: one round
    without_prior = guarded(FLAT, prior_rounds=0, probe_rounds=6)
    greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=without_prior)
    assert drafter.last_stats.widths_per_round[1:7] == [6] * 6  # a probe window: six rounds before judging


def test_drafting_pauses_only_where_it_loses_by_more_than_the_pause_margin():
    """Rejected drafts (τ near 1): where a round costs 10.5 ms against a 10 ms plain step (a 5 % loss) the default
    guard (margin 0.1) keeps drafting while one pausing at break-even falls back to plain steps; on FLAT costs (a
    round 12 ms: a 17 % loss) the default guard falls back too."""
    target, drafter, prompt = pair()
    plain = greedy_generate(target, prompt, 40, None)
    near = CostModel(target_ms={1: 10.0, 8: 9.0}, drafter_ms={2: 1.5, 8: 1.5})
    paused = {}
    for name, cost, margin in (("near tie", near, PAUSE_MARGIN), ("at break-even", near, 0.0), ("loss", FLAT, 0.1)):
        guard = guarded(cost, pause_margin=margin)
        assert guard.speculation_can_pay(6)
        out = greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=guard)
        assert torch.equal(out, plain)
        assert drafter.last_stats.tau < 1.2
        paused[name] = 1 in drafter.last_stats.widths_per_round[1:-3]  # the last rounds draft what tokens are left
    assert PAUSE_MARGIN == SpeculationGuard(DraftController(6)).pause_margin == 0.1
    assert paused == {"near tie": False, "at break-even": True, "loss": True}


def test_a_round_is_priced_at_the_width_it_drafted():
    cost = CostModel(target_ms={1: 10.0, 2: 11.0, 6: 12.0}, drafter_ms={2: 1.0, 6: 2.0})
    seconds = {}
    for width in (None, 2):
        guard = guarded(cost, prior_rounds=0)
        guard.begin(0.0, 6)
        assert guard.width() == 6
        guard.observe(1, 1, width)
        seconds[width] = guard.modeled_seconds
    assert seconds[None] == pytest.approx(cost.modeled_round_ms(6, 1, 0.0) / 1000)  # the guard's own width
    assert seconds[2] == pytest.approx(cost.modeled_round_ms(2, 1, 0.0) / 1000)  # the width the round drafted


def test_a_single_request_is_judged_by_its_own_controller_s_evidence():
    cost = CostModel(target_ms={1: 10.0, 2: 12.0, 6: 14.0}, drafter_ms={2: 1.5, 6: 2.0})  # drafting pays 1.24x
    judged = DraftController(3)
    judged.evidence = TauEvidence({1: 1.0, 2: 1.7, 3: 2.2}, prior_trials=4.0)  # as a τ policy's start leaves it
    pauses = {}
    for source in (None, judged):
        guard = guarded(cost)
        if source is not None:
            guard.judge_by(source)
        guard.begin(0.0, 3)
        assert guard.width() > 1
        guard.observe(2, 0, 3)  # an unlucky first round: both drafts rejected
        judged.evidence.observe(2, 0)  # the loop tells the row's controller too
        pauses[source is None] = guard.paused_for
    # on its own counts the first round pauses drafting; on the request's corrected τ it does not
    assert pauses == {True: guard.first_pause, False: 0}


def test_drafting_that_pays_never_pauses():
    target, _, prompt = pair()
    plain = greedy_generate(target, prompt, 40, None)
    torch.manual_seed(3)
    drafter = ScriptedDrafter.from_target(target, block_size=6).eval().rig(target, plain[0], error_rate=0.0)
    out = greedy_generate(
        target, prompt, 40, None, assistant_model=drafter, draft_controller=guarded(FLAT, probe_rounds=2)
    )
    assert torch.equal(out, plain)
    assert drafter.last_stats.plain_rounds == 0 and drafter.last_stats.tau > 3


def test_drafting_resumed_after_a_pause_sees_the_whole_context(built_decoders):
    target, drafter, prompt = pair(seed=4)
    guard = guarded(FLAT, probe_rounds=1, first_pause=2, decay=0.0)
    out = greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=guard)
    decoder = built_decoders[-1]
    assert drafter.last_stats.plain_rounds > 0
    # what the generator's cache (built across pauses) drafts equals a fresh cache fed the whole context
    with torch.no_grad():
        states = target(out, output_hidden_states=True).hidden_states
    pending = [hidden for hidden, *_ in decoder.pending]
    seen = decoder.draft_cache.get_seq_length() + sum(h.shape[1] for h in pending)
    assert seen == out.shape[1] - 1  # every committed token but the last (the next round's anchor)
    hidden = torch.cat([states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    block = drafter.embed_block(target.get_input_embeddings(), torch.full((1, 4), drafter.mask_token_id))
    positions = torch.arange(seen, seen + 4)[None]

    def draft(cache: DraftContextCache, new: torch.Tensor) -> torch.Tensor:
        start = cache.get_seq_length()
        context_positions = torch.arange(start, start + new.shape[1])[None]
        with torch.no_grad():
            return drafter(
                block_embeds=block,
                block_position_ids=positions,
                target_hidden=new,
                context_position_ids=context_positions,
                cache=cache,
            ).last_hidden_state

    pending = torch.cat(pending, dim=1) if pending else hidden[:, :0]
    resumed = draft(decoder.draft_cache, pending)
    fresh = draft(DraftContextCache(), hidden[:, :seen])
    torch.testing.assert_close(resumed, fresh, rtol=1e-5, atol=1e-5)


def test_measured_timing_learns_the_plain_step_from_its_pauses(built_decoders):
    """Wall-clock judging: every round (drafting or plain) takes 20 ms on this fake clock, twice the cost model's
    plain step. Drafting rounds that commit one token lose against the modeled 10 ms step, and again against
    the 20 ms plain steps the first pause measured; the guard learned that plain step."""
    target, drafter, prompt = pair()
    ticks = iter(range(10_000))
    guard = guarded(FLAT, timing="measured", clock=lambda: 0.02 * next(ticks), probe_rounds=2, first_pause=3)
    plain = greedy_generate(target, prompt, 60, None)
    out = greedy_generate(target, prompt, 60, None, assistant_model=drafter, draft_controller=guard)
    assert torch.equal(out, plain) and drafter.last_stats.plain_rounds >= 3
    assert built_decoders[-1].guard.plain_seconds == pytest.approx(0.02)
    copy = guard.for_request()  # a fresh request's guard knows no plain step yet
    assert copy.plain_seconds is None and copy.timing == "measured"


@pytest.mark.parametrize("accepted", [0, 1, 5])
def test_max_slowdown_bounds_each_request_s_loss_at_every_round(accepted):
    """Rounds of 6 slots cost 1.5 plain steps; every round accepts `accepted` of its 5 drafts. With
    `max_slowdown=0.05` the request's time never exceeds plain decoding's for its tokens by more than 1 / 0.95, at
    any round, yet it drafts once plain steps (and rounds that pay) have earned the budget; without the bound the
    first losing round alone is 1.5x."""
    cost = CostModel(target_ms={1: 10.0, 6: 13.0}, drafter_ms={2: 2.0, 6: 2.0})

    def decode(**kwargs) -> tuple[float, int]:
        guard = guarded(cost, **kwargs).for_request()
        guard.begin(0.0, 6)
        spent = plain = worst = 0.0
        drafted = 0
        for _ in range(200):
            width = guard.width()
            verified, taken = (5, accepted) if width > 1 else (0, 0)
            spent += cost.modeled_round_ms(width, verified)
            plain += (taken + 1) * cost.round_ms(1)
            guard.observe(verified, taken)
            worst, drafted = max(worst, spent / plain), drafted + (width > 1)
        return worst, drafted

    worst, drafted = decode(max_slowdown=0.05)
    assert worst <= 1 / 0.95 + 1e-9 and drafted > 0
    if accepted == 0:
        assert decode()[0] == pytest.approx(1.5)
    if accepted == 5:  # nine plain steps earn the first round; its gains pay for every later one
        assert drafted == 191


def test_a_slowdown_bound_keeps_greedy_output_and_starts_with_plain_steps():
    target, drafter, prompt = pair()
    plain = greedy_generate(target, prompt, 40, None)
    guard = guarded(FLAT, max_slowdown=0.05)
    out = greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=guard)
    widths = drafter.last_stats.widths_per_round[1:]
    assert torch.equal(out, plain)
    assert widths[:2] == [1, 1] and 6 in widths  # a round of 1.2 plain steps waits for two plain steps' budget


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(prior_acceptance=1.5), "prior_acceptance"),
        (dict(decay=1.0), "prior_acceptance"),
        (dict(probe_rounds=0), "prior_acceptance"),
        (dict(prior_rounds=-1), "prior_rounds"),
        (dict(pause_margin=1.0), "pause_margin in"),
        (dict(pause_margin=-0.1), "pause_margin in"),
        (dict(timing="guessed"), "timing"),
        (dict(max_slowdown=0.0), "max_slowdown"),
        (dict(max_slowdown=1.0), "max_slowdown"),
    ],
)
def test_bad_guard_settings_are_clear_errors(kwargs, error):
    with pytest.raises(ValueError, match=error):
        SpeculationGuard(DraftController(4), **kwargs)
    with pytest.raises(TypeError, match="wraps a DraftController"):
        SpeculationGuard(4)
