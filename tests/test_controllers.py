"""Draft controllers: the per-call seam, each strategy's decisions, and lossless greedy decoding with them on."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ScriptedDrafter, greedy_generate, make_drafter, make_target

from hf_blockpilot.controllers import (
    MAX_BLOCK_SIZE,
    AcceptanceModel,
    AdaptiveVerify,
    DraftController,
    DraftedRound,
    EntropyBound,
    PolicyBlockSize,
    SpeculationGuard,
    TauEvidence,
    check_block_size,
    default_controller,
    expected_committed,
    fastest_width,
    geometric_tau,
)
from hf_blockpilot.costs import CostModel
from hf_blockpilot.stats import SpeculationStats
from hf_blockpilot.tools.baselines import AcceptanceEMA, EntropyStop, HeuristicSchedule
from hf_blockpilot.tools.evaluation import round_oracle_ms

VOCAB, HIDDEN = 48, 64


def _cost(target_ms: dict[int, float], drafter_ms: float = 5.0) -> CostModel:
    return CostModel(target_ms=target_ms, drafter_ms={b: drafter_ms for b in range(2, 33)})


def test_expected_committed_counts_the_bonus_and_chained_acceptance():
    got = expected_committed(torch.tensor([0.5, 0.5, 1.0]))
    assert torch.allclose(got, torch.tensor([1.0, 1.5, 1.75, 2.0]))


def test_adaptive_verify_maximises_expected_tokens_per_ms():
    """Brute force over k: the choice is the argmax of E[committed](k) / round cost(k)."""
    rng = random.Random(0)
    for case in range(50):
        width = rng.randint(2, 12)
        costs = {n: 50.0 + rng.uniform(0, 15) * (n - 1) for n in range(1, 13)}
        model = AcceptanceModel(
            bias=[rng.uniform(-2, 2) for _ in range(4)],
            confidence_weight=[rng.uniform(0, 2) for _ in range(4)],
            entropy_weight=[rng.uniform(-1, 0) for _ in range(4)],
        )
        controller = AdaptiveVerify(width, acceptance=model, cost_model=_cost(costs)).for_request()
        confidence = torch.rand(width - 1)
        entropy = torch.rand(width - 1) * 3
        drafted = DraftedRound(width - 1, confidence, entropy)
        acceptance = model.per_slot(drafted)
        best, best_rate = 0, 0.0
        for k in range(width):
            survive = torch.cumprod(acceptance[:k], 0).sum().item() if k else 0.0
            rate = (1 + survive) / (5.0 + costs[k + 1])
            if rate > best_rate + 1e-9:
                best, best_rate = k, rate
        assert controller.num_to_verify(drafted) == best, case


def test_adaptive_verify_truncates_on_expensive_verification_and_keeps_all_on_free():
    sure = DraftedRound(7, torch.full((7,), 0.99), torch.zeros(7))
    unsure = DraftedRound(7, torch.full((7,), 0.3), torch.full((7,), 3.0))
    flat = AdaptiveVerify(8, cost_model=_cost({1: 50.0, 8: 50.0})).for_request()
    steep = AdaptiveVerify(8, cost_model=_cost({1: 50.0, 8: 400.0})).for_request()
    assert flat.num_to_verify(sure) == 7  # verifying is free: all drafts
    assert steep.num_to_verify(unsure) == 0  # costly and hopeless: none
    assert 0 < steep.num_to_verify(sure) <= 7
    # lookup rounds use the lookup rate (one-hot drafts carry no confidence)
    lookup = DraftedRound(5, lookup=True)
    assert (
        AdaptiveVerify(8, acceptance=EntropyBound(lookup_rate=0.0), cost_model=_cost({1: 50.0, 8: 400.0}))
        .for_request()
        .num_to_verify(lookup)
        == 0
    )


def test_entropy_stop_cuts_at_the_first_uncertain_slot():
    controller = EntropyStop(max_block_size=8, gamma=1.0, threshold=0.5)
    entropy = torch.tensor([0.0, 0.01, 0.9, 0.0])  # bound 1 - sqrt(H): 1, 0.9, 0.05, 1
    assert controller.num_to_verify(DraftedRound(4, torch.ones(4), entropy)) == 2
    assert controller.num_to_verify(DraftedRound(4, torch.ones(4), torch.zeros(4))) == 4


def test_heuristic_and_ema_schedules_follow_acceptance():
    heuristic = HeuristicSchedule(start_block_size=4, max_block_size=9).for_request()
    widths = []
    for verified, accepted in [(3, 3), (5, 5), (7, 7), (8, 2), (7, 0)]:
        widths.append(heuristic.width())
        heuristic.observe(verified, accepted)
    assert widths == [4, 6, 8, 9, 8]
    assert heuristic.for_request().width() == 4  # per-request state starts afresh
    ema = AcceptanceEMA(max_block_size=16, decay=0.5, start_block_size=4).for_request()
    for _ in range(10):
        ema.observe(15, 15)
    assert ema.width() == 16
    for _ in range(10):
        ema.observe(3, 0)
    assert ema.width() == 2


def test_acceptance_model_and_cost_model_round_trip():
    model = AcceptanceModel(
        bias=[0.1, 0.2], confidence_weight=[1.0, 0.9], entropy_weight=[-0.1, -0.2], lookup_rate=[0.8, 0.5], rounds=12
    )
    assert AcceptanceModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="one length"):
        AcceptanceModel(bias=[0.1], confidence_weight=[1.0, 2.0], entropy_weight=[0.0])
    drafted = DraftedRound(4, torch.tensor([0.9, 0.9, 0.9, 0.9]), torch.zeros(4))
    per_slot = model.per_slot(drafted)
    assert per_slot[2] == per_slot[3]  # slots past the fitted ones reuse the last
    assert torch.allclose(model.per_slot(DraftedRound(3, lookup=True)), torch.tensor([0.8, 0.5, 0.5]))
    cost = _cost({1: 10.0, 4: 40.0})
    assert cost.verify_ms(2) == pytest.approx(20.0) and cost.verify_ms(8) == pytest.approx(80.0)
    assert CostModel.from_dict(cost.to_dict()) == cost
    for device in ("cpu", "cuda"):
        shipped = CostModel.default_for(device)
        assert shipped.verify_ms(1) > 0 and shipped.draft_ms(16) > 0
    with pytest.raises(ValueError, match="target_ms\\[1\\]"):
        CostModel.from_dict({"target_ms": {"4": 1.0}, "drafter_ms": {}})


def test_block_size_bounds_and_controller_type_errors():
    for bad in (1, 0, MAX_BLOCK_SIZE + 1, 4.0, True):
        with pytest.raises(ValueError, match="2..256"):
            check_block_size(bad)
    with pytest.raises(TypeError, match="block-size policy"):
        PolicyBlockSize(object())
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=0)
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="DraftController"):
        greedy_generate(target, prompt, 4, None, assistant_model=drafter, draft_controller="adaptive")
    with pytest.raises(ValueError, match="assistant_model=<BlockDiffusionDrafter>"):
        greedy_generate(target, prompt, 4, None, draft_controller=DraftController(4))


def test_controller_is_per_call_and_leaves_the_drafter_alone():
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, seed=2)
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    expected = greedy_generate(target, prompt, 20, None)
    shared = HeuristicSchedule(start_block_size=3, max_block_size=12)
    for controller, width in [(DraftController(7), 7), (9, 9), (shared, 3), (shared, 3), (None, 4)]:
        out = greedy_generate(target, prompt, 20, None, assistant_model=drafter, draft_controller=controller)
        assert torch.equal(out, expected)
        assert drafter.last_stats.block_size == width
        assert drafter.block_size == 4
    assert shared.current == 3  # each request schedules on its own copy


def _random_controller(rng: random.Random, block_size: int) -> DraftController:
    kind = rng.choice(["adaptive", "adaptive-calibrated", "entropy", "heuristic", "ema"])
    cost = _cost({1: 50.0, 2: 55.0, 4: 60.0 + rng.uniform(0, 60), 16: 80.0 + rng.uniform(0, 300)})
    if kind == "adaptive":
        return AdaptiveVerify(block_size, acceptance=EntropyBound(gamma=rng.uniform(0.05, 1.0)), cost_model=cost)
    if kind == "adaptive-calibrated":
        model = AcceptanceModel(
            bias=[rng.uniform(-3, 1)],
            confidence_weight=[rng.uniform(0.5, 2)],
            entropy_weight=[rng.uniform(-1, 0)],
            lookup_rate=[rng.uniform(0, 1)],
        )
        return AdaptiveVerify(block_size, acceptance=model, cost_model=cost)
    if kind == "entropy":
        return EntropyStop(block_size, gamma=rng.uniform(0.1, 1.0), threshold=rng.uniform(0.2, 0.9))
    if kind == "heuristic":
        return HeuristicSchedule(rng.randint(2, block_size), block_size)
    return AcceptanceEMA(block_size, decay=rng.uniform(0.0, 0.9), start_block_size=rng.randint(2, block_size))


def test_greedy_identical_with_controllers_over_randomized_cases():
    """>= 200 randomized cases: targets, prompts, lengths, EOS, reduced vocabularies, prompt lookup, drafters
    right at varied confidence, and every controller; full and partial acceptance and truncation must occur."""
    targets = {fam: make_target(fam, vocab_size=VOCAB, hidden_size=HIDDEN, seed=1) for fam in ("llama", "qwen3")}
    seen = dict(full=0, partial=0, truncated=0, lookup=0)
    for case in range(200):
        rng = random.Random(1000 + case)
        family = rng.choice(sorted(targets))
        target = targets[family]
        prompt_len, block_size, max_new = rng.randint(1, 48), rng.randint(2, 24), rng.randint(1, 48)
        prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(case))
        if rng.random() < 0.3:  # repeat a span so prompt lookup has something to copy
            prompt = torch.cat([prompt, prompt[:, : rng.randint(1, prompt_len)]], dim=1)
        eos = None
        if rng.random() < 0.3:
            free = greedy_generate(target, prompt, max_new, None)[0, prompt.shape[1] :]
            eos = int(free[rng.randrange(free.numel())])
        expected = greedy_generate(target, prompt, max_new, eos)
        draft_vocab = sorted(rng.sample(range(VOCAB), VOCAB // 2)) if rng.random() < 0.2 else None
        torch.manual_seed(case)
        drafter = ScriptedDrafter.from_target(target, block_size=block_size, draft_vocab=draft_vocab).eval()
        drafter.rig(target, expected, error_rate=rng.choice([0.0, 0.1, 0.3]), seed=case, varied_confidence=True)
        drafter.prompt_lookup = rng.random() < 0.3
        controller = _random_controller(rng, block_size)

        got = greedy_generate(target, prompt, max_new, eos, assistant_model=drafter, draft_controller=controller)
        msg = f"case {case}: {family} prompt={prompt.shape[1]} {controller.describe()} max_new={max_new} eos={eos}"
        assert torch.equal(got, expected), msg
        stats = drafter.last_stats
        assert stats.new_tokens == expected.shape[1] - prompt.shape[1] == sum(a + 1 for a in stats.accepted_per_round)
        assert len(stats.widths_per_round) == len(stats.drafted_per_round) == stats.target_forwards, msg
        room = expected.shape[1] - prompt.shape[1]
        for width, drafted, accepted in zip(stats.widths_per_round, stats.drafted_per_round, stats.accepted_per_round):
            assert 0 <= accepted <= drafted <= width - 1 <= block_size - 1, msg
            seen["full"] += drafted > 0 and accepted == drafted
            seen["partial"] += 0 < accepted < drafted
            seen["truncated"] += drafted < width - 1 and room > width
        seen["lookup"] += stats.lookup_rounds
    assert all(count >= 10 for count in seen.values()), seen


def test_round_oracle_takes_the_cheapest_verify_that_commits_the_same_tokens():
    """Per round: the drafting cost at its width plus the cheapest verify of at least the accepted drafts
    (verify latency need not grow with the count: here 4 tokens cost less than 3)."""
    cost = CostModel(target_ms={1: 10.0, 2: 12.0, 3: 30.0, 4: 14.0, 8: 40.0}, drafter_ms={4: 2.0, 8: 3.0})
    stats = SpeculationStats(
        widths_per_round=[1, 4, 4, 4, 8, 4], drafted_per_round=[0, 3, 3, 3, 7, 2], accepted_per_round=[0, 0, 2, 3, 1, 2]
    )
    # prefill; a=0 -> 1 token; a=2 -> 4 tokens beat 3; a=3 -> all; a=1 of 7 -> 2 tokens; a=2 of 2 -> 3 tokens
    expected = 10 + (2 + 10) + (2 + 14) + (2 + 14) + (3 + 12) + (2 + 30)
    assert round_oracle_ms(cost, stats) == pytest.approx(expected)
    assert round_oracle_ms(cost, stats) < cost.modeled_decode_ms(stats)
    assert cost.modeled_round_ms(1, 0, temperature=1.0) == cost.modeled_round_ms(1, 0) == 10.0  # no rows timed


def test_a_clairvoyant_verify_budget_attains_the_round_oracle():
    """Replaying a fixed-b run's accepted counts as the verify budget keeps the output and every round, and its
    modeled time is the round oracle's: the bound is attainable, so it is the right ceiling to report."""

    class Replay(DraftController):
        def __init__(self, accepted):
            super().__init__(6)
            self.accepted = accepted

        def num_to_verify(self, drafted):
            return self.accepted[len(self.seen)]

        def reset(self):
            super().reset()
            self.seen = []  # rounds observed so far (round 0 is the prefill)

        def observe(self, verified, accepted):
            self.seen.append(accepted)

    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=3)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = greedy_generate(target, prompt, 40, None)
    drafter = ScriptedDrafter.from_target(target, block_size=6).eval()
    drafter.rig(target, expected, error_rate=0.3, seed=3, by_position=True)  # the same drafts at a position
    cost = _cost({1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}, drafter_ms=3.0)
    assert torch.equal(greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=6), expected)
    fixed = drafter.last_stats
    assert 0 < sum(fixed.accepted_per_round) < sum(fixed.drafted_per_round)  # partial acceptance occurred
    out = greedy_generate(
        target, prompt, 40, None, assistant_model=drafter, draft_controller=Replay(fixed.accepted_per_round)
    )
    assert torch.equal(out, expected)
    clairvoyant = drafter.last_stats
    assert clairvoyant.accepted_per_round == clairvoyant.drafted_per_round == fixed.accepted_per_round
    assert clairvoyant.widths_per_round == fixed.widths_per_round
    assert cost.modeled_decode_ms(clairvoyant) == pytest.approx(round_oracle_ms(cost, fixed))
    assert round_oracle_ms(cost, fixed) < cost.modeled_decode_ms(fixed)


def test_policy_width_under_adaptive_verify():
    """The per-request policy picks the drafting width; the per-round controller truncates within it."""

    class PickSix(torch.nn.Module):
        candidates = [2, 6]
        feature_layers = [0]

        def check_compatible(self, target, drafter=None):
            pass

        def choose_block_size(self, prefill_outputs, lm_head, temperature):
            return 6, {2: 0.1, 6: 0.9}

    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=4)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = greedy_generate(target, prompt, 30, None)
    drafter = ScriptedDrafter.from_target(target, block_size=16).eval()
    drafter.rig(target, expected, error_rate=0.3, seed=4, varied_confidence=True)
    controller = AdaptiveVerify(policy=PickSix(), cost_model=_cost({1: 50.0, 6: 150.0}))
    out = greedy_generate(target, prompt, 30, None, assistant_model=drafter, draft_controller=controller)
    assert torch.equal(out, expected)
    stats = drafter.last_stats
    assert stats.block_size == 6 and stats.policy_probs == {2: 0.1, 6: 0.9}
    assert max(stats.widths_per_round) == 6
    assert any(d < w - 1 for d, w in zip(stats.drafted_per_round, stats.widths_per_round) if w > 1)
    assert stats.controller_seconds > 0 and "adaptive(policy" in stats.controller


@pytest.mark.parametrize("block_size", [2, 5])
def test_the_default_is_the_guarded_fixed_block_size_and_drafts_as_it_where_drafting_pays(block_size, monkeypatch):
    # a drafting round costs less than a (slow) plain step: any round pays, so the guard never pauses
    flat = CostModel(target_ms={1: 1000.0, 2: 900.0, 16: 900.0}, drafter_ms={2: 0.0, 16: 0.0})
    monkeypatch.setattr(CostModel, "default_for", classmethod(lambda cls, device: flat))
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, seed=5)
    drafter = make_drafter(target, block_size=block_size, scale=4.0)
    default = default_controller(drafter)
    assert isinstance(default, SpeculationGuard) and type(default.inner) is DraftController
    assert default.describe() == f"guarded(fixed(b={block_size}))"
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    greedy_generate(target, prompt, 24, None, assistant_model=drafter)
    guarded = drafter.last_stats
    greedy_generate(target, prompt, 24, None, assistant_model=drafter, draft_controller=DraftController(block_size))
    assert drafter.last_stats.accepted_per_round == guarded.accepted_per_round
    assert drafter.last_stats.drafted_per_round == guarded.drafted_per_round
    assert guarded.plain_rounds == drafter.last_stats.plain_rounds  # the last token: no room to draft
    assert guarded.controller == f"guarded(fixed(b={block_size}))"


PREDICTED = {1: 1.0, 2: 1.9, 4: 3.5, 8: 6.2}  # a τ policy's prediction (consistent: gains per slot fall)


class _StubTauPolicy:
    """A τ policy that picks `chosen` for every request and predicts `PREDICTED`."""

    candidates = list(PREDICTED)
    weighs_costs = True

    def __init__(self, chosen: int):
        self.chosen = chosen

    def choose_block_size(self, prefill_outputs, lm_head, temperature, cost_model=None):
        return self.chosen, dict(PREDICTED)

    def check_compatible(self, target, drafter=None):
        pass


def test_tau_evidence_starts_at_the_prediction_and_follows_the_rounds():
    evidence = TauEvidence(dict(PREDICTED))
    assert evidence.current() == pytest.approx(PREDICTED)  # no round yet: the prediction itself
    assert 0.7 < evidence.prior_acceptance < 0.95  # the geometric fit of 1.9 / 3.5 / 6.2
    assert geometric_tau(evidence.prior_acceptance, 4) == pytest.approx(3.5, rel=0.1)
    rejected = TauEvidence(dict(PREDICTED))
    for _ in range(4):
        rejected.observe(verified=7, accepted=0)
    accepted = TauEvidence(dict(PREDICTED))
    for _ in range(4):
        accepted.observe(verified=7, accepted=7)
    low, high = rejected.current(), accepted.current()
    assert low[8] < 2.0 < PREDICTED[8] < high[8] <= 8.0
    assert all(1.0 <= low[b] <= high[b] <= b for b in PREDICTED)
    assert low[1] == high[1] == 1.0
    rejected.observe(verified=0, accepted=0)  # a plain round is no evidence
    assert rejected.current() == low


def test_tau_evidence_shape_gives_way_to_the_requests_own_acceptance():
    """A policy that over-predicts wide blocks against narrow ones (the shape of τ(b), not only its level) keeps
    steering a request wide if only the level is corrected; weighed as `shape_trials`, its shape gives way, τ(b)
    tends to the geometric τ(b) at the observed acceptance, and the narrow width the rounds favour is taken."""
    wide = {1: 1.0, 2: 1.6, 4: 2.5, 8: 2.7}  # τ(4) - 1 is 2.5x τ(2) - 1: flatter per-slot acceptance than observed
    cost = _cost({1: 10.0, 2: 13.0, 4: 16.0, 8: 21.0}, drafter_ms=0.0)
    kept, fading = TauEvidence(dict(wide)), TauEvidence(dict(wide), shape_trials=2.0)
    assert fading.current() == pytest.approx(wide)  # no round yet: the prediction itself
    for accepted in [1, 0, 0, 2, 1, 0, 0, 1, 0, 3, 0, 1] * 3:  # rounds of b = 4: about 0.45 per slot
        kept.observe(3, accepted)
        fading.observe(3, accepted)
    assert fading.acceptance == kept.acceptance
    geometric = {b: geometric_tau(fading.acceptance, b) for b in wide}
    assert fading.current() == pytest.approx(geometric, rel=0.05)
    assert fastest_width([kept.current()], cost, 0.0)[0] == 4  # the level corrected, the shape still says wide
    assert fastest_width([fading.current()], cost, 0.0)[0] == 2


def test_fastest_width_prices_the_slowest_row():
    """A batch round's worth is its slowest row's τ: the mean of these rows favours b = 8, the slowest b = 4."""
    cost = _cost({1: 10.0, 4: 12.0, 8: 16.0}, drafter_ms=1.0)
    sure, unsure = {1: 1.0, 4: 3.9, 8: 7.8}, {1: 1.0, 4: 2.2, 8: 2.4}
    assert fastest_width([sure], cost, 0.0)[0] == 8
    width, gain = fastest_width([sure, unsure], cost, 0.0)
    assert width == 4 and gain == pytest.approx(2.2 * 10.0 / 13.0)
    assert fastest_width([{1: 1.0}], cost, 0.0) == (1, 0.0)  # no drafting width: nothing to pick
    assert fastest_width([sure], cost, 0.0, grown_from=3)[0] == 4  # none wider than WIDTH_GROWTH times the last
    assert fastest_width([sure], cost, 0.0, grown_from=4)[0] == 8
    sparse = _cost({1: 10.0, 2: 11.0, 16: 16.0}, drafter_ms=1.0)
    # but the next wider candidate, however far: sparse candidates still widen, a step at a time
    assert fastest_width([{1: 1.0, 2: 1.9, 16: 15.0}], sparse, 0.0, grown_from=2)[0] == 16


def test_a_policy_width_follows_the_requests_acceptance():
    """The width a τ policy chose is corrected by the request's own rounds: drafts the target rejects shrink it
    within a few rounds, drafts it accepts widen it (up to the widest candidate); `correct_width=False` keeps it."""
    cost = _cost({1: 10.0, 2: 11.0, 4: 12.0, 8: 15.0}, drafter_ms=1.0)

    def started(chosen: int, **kwargs) -> PolicyBlockSize:
        controller = PolicyBlockSize(_StubTauPolicy(chosen), **kwargs).for_request()
        controller.use_cost_model(cost)
        controller.start(None, None, 0.0)
        return controller

    shrinking = started(8)
    assert shrinking.width() == 8 and shrinking.max_width() == 8
    widths = []
    for _ in range(10):
        shrinking.observe(shrinking.width() - 1, 0)
        widths.append(shrinking.width())
    assert widths[1] == 4 and widths[-1] == 2 and widths == sorted(widths, reverse=True), widths
    growing, widths = started(2), []
    for _ in range(6):
        growing.observe(growing.width() - 1, growing.width() - 1)
        widths.append(growing.width())
    assert growing.width() == 8 and growing.max_width() == 8
    assert widths[:2] == [4, 8], widths  # at most WIDTH_GROWTH times wider a round, however sure the evidence
    fixed = started(8, correct_width=False)
    for _ in range(4):
        fixed.observe(7, 0)
    assert fixed.width() == 8 and fixed.describe() == "policy(uncorrected)"
    plain = started(1)
    plain.observe(0, 0)
    assert plain.width() == 1 and plain.max_width() == 1  # plain stays plain: drafting is the guard's call
    with pytest.raises(ValueError, match="prior_trials must be > 0"):
        PolicyBlockSize(_StubTauPolicy(2), prior_trials=0)


def test_the_guard_judges_a_tau_policy_by_its_corrected_evidence():
    """One unlucky round pauses a guard that counts the rounds' tokens, not one whose τ policy's evidence (the
    prediction corrected by every round) says drafting pays; a run of rejected rounds pauses both."""
    cost = _cost({1: 10.0, 2: 11.0, 4: 12.0, 8: 15.0}, drafter_ms=1.0)

    def guarded(inner: DraftController) -> SpeculationGuard:
        guard = SpeculationGuard(inner, timing="modeled", pause_margin=0.0).for_request()
        guard.use_cost_model(cost)
        guard.start(None, None, 0.0)
        return guard

    counting, judging = guarded(DraftController(8)), guarded(PolicyBlockSize(_StubTauPolicy(8)))
    for guard in (counting, judging):
        assert guard.width() == 8
        guard.observe(7, 0)
    assert counting.width() == 1 and judging.width() > 1
    widths = []
    for _ in range(12):
        widths.append(judging.width())
        judging.observe(widths[-1] - 1 if widths[-1] > 1 else 0, 0)
    assert widths[0] > 1 and 1 in widths, widths
