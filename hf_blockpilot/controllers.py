"""How many tokens to draft and verify, per request and per round: the one seam every strategy plugs into.

A controller is passed per call, `target.generate(..., assistant_model=drafter, draft_controller=c)` (like
gpt-fast's `speculate_k`); each request works on its own copy (`for_request`), so one object serves many calls
and threads. Per request, `start` sees the target's prefill; per round, `width` says how many slots the drafter
drafts (anchor included), `num_to_verify` how many of the drafts go to the target, from what the drafter
computed (per-slot confidence and entropy), and `observe` hears how many were accepted.

Every decision depends only on the drafter's outputs and earlier rounds, never on the target's verdict on the
drafts it is deciding about, so decoding stays lossless: greedy output equals plain `generate`, and with
sampling the verifier's test runs on exactly the distributions the kept drafts were drawn from.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .costs import MIN_PREDICTED_GAIN, PRIOR_ACCEPTANCE, CostModel, geometric_tau

MAX_BLOCK_SIZE = 256  # the widest block a controller may draft: far past any DFlash drafter's training size


@runtime_checkable
class BlockSizePolicy(Protocol):
    """A per-request policy: picks a block size from the target's prefill (`BlockPilotPolicy` is one).

    Optional attributes: `candidates` (the block sizes it picks from), `feature_layers` (target layer ids whose
    prefill states it reads; absent: the target keeps them all), `acceptance_model` and `cost_model` (what an
    `AdaptiveVerify` under it uses unless given its own), `serving_controller` (or, as before it,
    `label_controller`; "adaptive": generate serves it under `AdaptiveVerify` by default; absent or "fixed": every
    draft verified), `weighs_costs` (true: `choose_block_size` also takes `cost_model=`, this machine's costs).
    """

    def choose_block_size(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> tuple[int, dict]: ...

    def check_compatible(self, target: nn.Module, drafter: nn.Module | None = None) -> None: ...


def policy_state_indices(policy: BlockSizePolicy) -> set[int] | None:
    """The prefill `hidden_states` entries a policy reads: those of its `feature_layers` (layer id i is entry
    i + 1; its next-token distribution comes from the prefill's logits); `None` (all) if it does not say which
    layers."""
    layers = getattr(policy, "feature_layers", None)
    return None if layers is None else {i + 1 for i in layers}


@dataclass
class DraftedRound:
    """What a controller sees of a round before anything is verified.

    `confidence` and `entropy` (k,) describe each drafted slot's draft distribution (its top probability and
    its entropy in nats, from the drafter's logits at the request's temperature); both are `None` for
    controllers that do not read them. `lookup`: the drafts were copied by prompt lookup (one-hot).
    """

    num_drafts: int
    confidence: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    lookup: bool = False


def check_max_slowdown(max_slowdown: float | None) -> float | None:
    """`max_slowdown` (a `SpeculationGuard`'s per-request bound) if it is None or in (0, 1), else a ValueError."""
    if max_slowdown is not None and not 0.0 < max_slowdown < 1.0:
        raise ValueError(f"max_slowdown must be in (0, 1) (0.05: at most 5 % slower) or None, got {max_slowdown}")
    return max_slowdown


def check_block_size(block_size: Any, what: str = "block size") -> int:
    """`block_size` if it is an int in 2..MAX_BLOCK_SIZE (anchor slot + at least one draft), else a ValueError."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"{what} must be an int in 2..{MAX_BLOCK_SIZE} (anchor slot + at least one draft), got {block_size!r}"
        )
    return block_size


#: A corrected width grows at most this many times a round: one lucky round is little evidence (on a Zen 1 EPYC a
#: first round with 2 of 2 drafts accepted moved a request from 3 slots to 12, and 6 losing rounds followed).
WIDTH_GROWTH = 2


class DraftController:
    """Fixed block size, every draft verified: the behaviour of every other DFlash implementation.

    Subclasses override the hooks they need. State kept per request lives on the copy `for_request` returns.
    """

    name = "fixed"
    reads_confidence = False  # whether `num_to_verify` needs per-slot confidences (a softmax per round)
    chooses_verify_count = False  # whether `num_to_verify` may send fewer than all drafts to the target
    correct_width = False  # whether a τ policy's width follows the acceptance the request's rounds show
    prior_trials = 2.0  # what a τ policy's prediction weighs against observed slots (`TauEvidence`)

    def __init__(self, block_size: int = 16):
        self.block_size = check_block_size(block_size)
        self.policy_probs: dict[int, float] | None = None
        self.policy_seconds = 0.0
        self.cost_model: CostModel | None = None  # this device's costs (see `use_cost_model`)
        self.temperature = 0.0
        self.evidence: TauEvidence | None = None

    def for_request(self) -> DraftController:
        """A copy with fresh per-request state (models and tables are shared, not copied)."""
        fresh = copy.copy(self)
        fresh.reset()
        return fresh

    def reset(self) -> None:
        """Clear per-request state."""
        self.policy_probs = None
        self.policy_seconds = 0.0
        self.evidence = None

    def check_compatible(self, target: nn.Module, drafter: nn.Module) -> None:
        """Error early if this controller cannot serve `target` + `drafter`."""

    def use_cost_model(self, cost_model: CostModel) -> None:
        """Decide with `cost_model`: the device's costs, which `generate` resolves per request
        (`device_calibration.resolve_cost_model`) unless the controller was given its own."""
        self.cost_model = cost_model

    def prefill_state_indices(self) -> set[int] | None:
        """The prefill `hidden_states` entries `start` reads (`None`: it may read any)."""
        return set()

    def start(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> None:
        """Called once per request, after the prefill."""

    def choose_with(
        self, policy: BlockSizePolicy, prefill_outputs: Any, lm_head: nn.Module, temperature: float
    ) -> None:
        """Take this request's block size (1: speculation off) and the candidates' scores from `policy`, timed
        (`policy_seconds`); a policy that weighs costs gets this request's cost model, and its predicted τ per
        candidate becomes the request's `evidence`, which the rounds' acceptance corrects."""
        begin = time.perf_counter()
        self.temperature = temperature
        if getattr(policy, "weighs_costs", False):
            chosen, self.policy_probs = policy.choose_block_size(
                prefill_outputs, lm_head, temperature, cost_model=self.cost_model
            )
        else:
            chosen, self.policy_probs = policy.choose_block_size(prefill_outputs, lm_head, temperature)
        self.block_size = max(chosen, 1)
        if getattr(policy, "weighs_costs", False):
            margin = policy.drafting_margin() if hasattr(policy, "drafting_margin") else MIN_PREDICTED_GAIN
            self.evidence = TauEvidence(self.policy_probs, self.prior_trials, margin, shape_trials=self.prior_trials)
        self.policy_seconds = time.perf_counter() - begin

    def tau_curve(self) -> dict[int, float] | None:
        """τ(b) per candidate width as this request now expects it: a τ policy's prediction, corrected by the
        acceptance of the rounds so far (`None`: this controller predicts none)."""
        return None if self.evidence is None else self.evidence.current()

    def width(self) -> int:
        """Slots to draft in the next round (anchor included; 1 = no drafting)."""
        return self.block_size

    def max_width(self) -> int:
        """The widest block this request may draft (a corrected width may grow to the widest candidate)."""
        if self.evidence is not None and self.correct_width and self.block_size > 1:
            return max(self.evidence.predicted)
        return self.block_size

    def num_to_verify(self, drafted: DraftedRound) -> int:
        """How many of the round's drafts (a prefix) the target verifies."""
        return drafted.num_drafts

    def observe(self, verified: int, accepted: int) -> None:
        """The outcome of a round: drafts verified and accepted. A request with `evidence` (a τ policy chose its
        width) takes it in; where `correct_width`, a drafting request's width becomes the fastest under the
        corrected τ and this device's costs, growing from the last as `fastest_width` allows (plain steps stay the
        guard's call)."""
        if self.evidence is None:
            return
        self.evidence.observe(verified, accepted)
        if self.correct_width and self.block_size > 1 and self.cost_model is not None:
            curve = self.evidence.current()
            self.block_size = fastest_width([curve], self.cost_model, self.temperature, self.block_size)[0]

    def describe(self) -> str:
        return f"{self.name}(b={self.block_size})"


class PolicyBlockSize(DraftController):
    """The block size chosen per request by a BlockPilot policy from the prefill; every draft verified.

    `correct_width` (default): a τ-predicting policy's choice is corrected during the request: its predicted
    τ per width, worth `prior_trials` slot trials of acceptance, is updated by every round's outcome
    (`TauEvidence`), and the next round drafts the width fastest under the updated τ and this device's costs."""

    name = "policy"

    def __init__(self, policy: BlockSizePolicy, correct_width: bool = True, prior_trials: float = 2.0):
        if not isinstance(policy, BlockSizePolicy):
            raise TypeError(f"expected a block-size policy (e.g. BlockPilotPolicy), got {type(policy).__name__}")
        if prior_trials <= 0:
            raise ValueError(f"prior_trials must be > 0, got {prior_trials}")
        self.policy = policy
        self.correct_width = correct_width
        self.prior_trials = prior_trials
        super().__init__(_widest(policy))

    def check_compatible(self, target: nn.Module, drafter: nn.Module) -> None:
        self.policy.check_compatible(target, drafter)

    def prefill_state_indices(self) -> set[int] | None:
        return policy_state_indices(self.policy)

    def start(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> None:
        self.choose_with(self.policy, prefill_outputs, lm_head, temperature)

    def describe(self) -> str:
        return "policy" if self.correct_width else "policy(uncorrected)"


@dataclass
class EntropyBound:
    """Training-free acceptance estimate (AdaEDL, Agrawal et al. 2024): a draft drawn from q is accepted with
    probability at least 1 - sqrt(gamma * H(q)); prompt-lookup drafts get `lookup_rate` per slot."""

    gamma: float = 0.5
    lookup_rate: float = 0.6

    def per_slot(self, drafted: DraftedRound) -> torch.Tensor:
        if drafted.lookup:
            return torch.full((drafted.num_drafts,), self.lookup_rate)
        return (1.0 - torch.sqrt(self.gamma * drafted.entropy.clamp(min=0.0))).clamp(0.0, 1.0)


@dataclass
class AcceptanceModel:
    """Calibrated acceptance: P(slot j's draft is accepted | the drafts before it were), per slot j,
    sigmoid(bias[j] + confidence_weight[j] * logit(confidence) + entropy_weight[j] * entropy); slots past the
    fitted ones reuse the last. Prompt-lookup drafts: `lookup_rate[j]`. Fitted by `fit_acceptance_model`
    from replayed rounds; saved inside a policy checkpoint (`BlockPilotPolicy(acceptance_model=...)`).
    """

    bias: list[float]
    confidence_weight: list[float]
    entropy_weight: list[float]
    lookup_rate: list[float] = field(default_factory=lambda: [0.6])
    rounds: int = 0  # rounds it was fitted on
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = {len(self.bias), len(self.confidence_weight), len(self.entropy_weight)}
        if len(sizes) != 1 or not self.bias or not self.lookup_rate:
            raise ValueError(
                "an acceptance model needs bias, confidence_weight and entropy_weight of one length >= 1, "
                "and at least one lookup rate"
            )

    def _table(self, num_slots: int, device: torch.device) -> torch.Tensor:
        key = (num_slots, str(device))
        if key not in self._tables:
            fitted = (self.bias, self.confidence_weight, self.entropy_weight, self.lookup_rate)
            rows = [[values[min(j, len(values) - 1)] for j in range(num_slots)] for values in fitted]
            self._tables[key] = torch.tensor(rows, dtype=torch.float32, device=device)
        return self._tables[key]

    def per_slot(self, drafted: DraftedRound) -> torch.Tensor:
        device = drafted.confidence.device if drafted.confidence is not None else torch.device("cpu")
        table = self._table(drafted.num_drafts, device)
        if drafted.lookup:
            return table[3]
        confidence = drafted.confidence.float().clamp(1e-4, 1 - 1e-4)
        logit = torch.log(confidence) - torch.log1p(-confidence)
        return torch.sigmoid(table[0] + table[1] * logit + table[2] * drafted.entropy.float())

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @classmethod
    def from_dict(cls, raw: dict) -> AcceptanceModel:
        return cls(**raw)


def expected_committed(acceptance: torch.Tensor) -> torch.Tensor:
    """(k + 1,) expected tokens committed when verifying the first 0..k drafts, bonus included:
    1 + sum over i <= n of P(drafts 1..i all accepted)."""
    survival = torch.cumprod(acceptance.float(), dim=0)
    return torch.cat([survival.new_ones(1), 1.0 + torch.cumsum(survival, dim=0)])


@functools.lru_cache(maxsize=64)
def _geometric_fit(fits: tuple[tuple[int, float], ...]) -> float:
    """The per-slot acceptance (0 .. 0.995 in steps of 0.005) whose `geometric_tau` fits the (width, τ) pairs best
    (least squares); kept, as the same fits recur (`LookupBudget`'s priors, every request)."""
    grid = [i / 200 for i in range(200)]
    return min(grid, key=lambda a: sum((geometric_tau(a, b) - t) ** 2 for b, t in fits))


@dataclass
class TauEvidence:
    """A request's predicted τ(b) per candidate width, corrected by the acceptance its own rounds show.

    The prediction (a τ policy's, made consistent) is read as a per-slot acceptance `prior_acceptance` (the
    geometric fit, `geometric_tau`) worth `prior_trials` slot trials; every verified slot is a trial (accepted
    drafts succeed, the first rejected one fails). `current()` scales each predicted τ(b) by how the posterior mean
    acceptance changes the geometric τ(b), so before any round it is the prediction itself. With `shape_trials`,
    the prediction's shape (its τ(b) over the geometric fit's) weighs that many slot trials against the request's
    own: as they accumulate, τ(b) tends to the geometric τ(b) at the observed acceptance, so a policy that
    over-predicts wide blocks against narrow ones stops steering the request wide (None: the shape is kept, as
    for measured lookup rates). `margin`: the policy's `drafting_margin`."""

    predicted: dict[int, float]
    prior_trials: float = 2.0
    margin: float = MIN_PREDICTED_GAIN  # the predicted gain over plain steps the policy needs before drafting
    shape_trials: float | None = None
    prior_acceptance: float = field(init=False)
    successes: float = field(init=False)
    failures: float = field(init=False)

    def __post_init__(self) -> None:
        self.prior_acceptance = _geometric_fit(tuple((b, t) for b, t in self.predicted.items() if b > 1))
        self.successes = self.prior_trials * self.prior_acceptance
        self.failures = self.prior_trials * (1.0 - self.prior_acceptance)

    def observe(self, verified: float, accepted: float) -> None:
        if verified > 0:
            self.successes += accepted
            self.failures += float(accepted < verified)

    @property
    def acceptance(self) -> float:
        """The posterior mean per-slot acceptance."""
        return self.successes / (self.successes + self.failures)

    def current(self) -> dict[int, float]:
        """τ(b) per candidate, corrected by the rounds observed so far (1 <= τ(b) <= b)."""
        now = self.acceptance
        shape = 1.0  # the power the prediction's shape keeps
        if self.shape_trials is not None:
            observed = self.successes + self.failures - self.prior_trials
            shape = self.shape_trials / (self.shape_trials + observed)
        return {
            b: min(max(geometric_tau(now, b) * (t / geometric_tau(self.prior_acceptance, b)) ** shape, 1.0), float(b))
            for b, t in self.predicted.items()
        }


#: Per-slot acceptance of prompt lookup's drafts, each given the ones before it accepted, after a match of 2 and of
#: 3 or more tokens: the lowest measured on the embedded target's greedy answers, rounded down (2: 0.50-0.53 over
#: training and evaluation answers; 3+: 0.76-0.91): docs/benchmarks.md, "Lookup acceptance by match length".
LOOKUP_ACCEPTANCE = {
    2: (0.50, 0.60, 0.70, 0.70, 0.75, 0.80, 0.80, 0.80),
    3: (0.75, 0.75, 0.80, 0.80, 0.80, 0.85, 0.85, 0.85),
}


class LookupBudget:
    """How many of prompt lookup's drafts a request whose drafter no longer drafts verifies a round: the count
    that commits the most tokens per ms of a round with no drafter forward under `cost_model`, at the request's
    acceptance of drafts looked up after a match of that length (`LOOKUP_ACCEPTANCE` worth `prior_trials` slots,
    corrected by its own lookup rounds after such matches, `TauEvidence`); 0: a plain step."""

    def __init__(self, cost_model: CostModel, temperature: float, prior_trials: float = 16.0):
        self.evidence = {
            n: TauEvidence(dict(enumerate(expected_committed(torch.tensor(rates)).tolist(), start=1)), prior_trials)
            for n, rates in LOOKUP_ACCEPTANCE.items()
        }
        self.cost_model = cost_model
        self.temperature = temperature
        self.most = max(len(rates) for rates in LOOKUP_ACCEPTANCE.values())
        self.matched = 0  # the match length of the round last decided

    def drafts(self, available: int, matched: int, rival_rate: float | None = None) -> int:
        """Of `available` drafts looked up after a `matched`-token n-gram (3 or more: alike), how many to verify;
        0 also where `rival_rate` (the tokens per ms expected of the round the request would draft otherwise)
        beats the best count's."""
        self.matched = min(matched, max(self.evidence))
        if available == 0 or self.matched not in self.evidence:
            return 0
        tau = self.evidence[self.matched].current()
        ms = self.cost_model.modeled_round_ms
        rates = [tau[k + 1] / max(ms(1, k, self.temperature), 1e-9) for k in range(min(available, self.most) + 1)]
        best = max(range(len(rates)), key=rates.__getitem__)
        return 0 if rival_rate is not None and rates[best] < rival_rate else best

    def observe(self, verified: int, accepted: int) -> None:
        """The outcome of the round `drafts` last decided (nothing verified: nothing learned)."""
        if verified:
            self.evidence[self.matched].observe(verified, accepted)


def fastest_width(
    curves: Sequence[dict[int, float]], cost_model: CostModel, temperature: float, grown_from: int | None = None
) -> tuple[int, float]:
    """The drafting width (>= 2, among the widths every curve predicts) at which the slowest of `curves` (one per
    row of a batch; one for a single request) commits the most tokens per ms of a round, every draft verified, under
    `cost_model`; and its predicted speedup over plain steps. A batch runs until its slowest row is done, so a
    round's worth is the least τ among its rows. `grown_from` (the width drafted last): none wider than
    `WIDTH_GROWTH` times it, but the next candidate wider than it, so evidence widens a block a step at a time."""
    widths = sorted(set.intersection(*(set(c) for c in curves)) - {1})
    if grown_from is not None:
        next_wider = min((w for w in widths if w > grown_from), default=None)
        widths = [w for w in widths if w <= WIDTH_GROWTH * grown_from or w == next_wider]
    plain_ms = cost_model.round_ms(1, temperature)
    best, best_gain = 1, 0.0
    for width in widths:
        gain = min(c[width] for c in curves) * plain_ms / cost_model.round_ms(width, temperature)
        if gain > best_gain:
            best, best_gain = width, gain
    return best, best_gain


class AdaptiveVerify(DraftController):
    """BlockPilot's per-round verify budget: draft a block, then verify the prefix of drafts that maximises
    expected committed tokens per millisecond of the round (the device's `CostModel`), with acceptance
    estimated per slot from the drafter's confidences (a calibrated `AcceptanceModel`, else the AdaEDL
    entropy bound).

    The drafting width is `block_size`, or chosen per request by `policy` (which may also carry the
    acceptance model it was trained with; an explicit `acceptance` wins) and, for a τ policy, corrected by the
    rounds' acceptance as in `PolicyBlockSize` (`correct_width`). The costs are `cost_model` if given,
    else this machine's calibration (resolved by `generate`, see `use_cost_model`); a policy's own cost model
    (from the machine its labels were timed on) is not used for decisions.
    """

    name = "adaptive"
    reads_confidence = True
    chooses_verify_count = True

    def __init__(
        self,
        block_size: int = 16,
        policy: BlockSizePolicy | None = None,
        acceptance: AcceptanceModel | EntropyBound | None = None,
        cost_model: CostModel | None = None,
        correct_width: bool = True,
    ):
        super().__init__(block_size if policy is None else _widest(policy))
        self.fixed_block_size = self.block_size
        self.correct_width = correct_width
        self.policy = policy
        self.acceptance = acceptance or getattr(policy, "acceptance_model", None) or EntropyBound()
        self.cost_model = cost_model
        self._costs: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        super().reset()
        self.block_size = self.fixed_block_size
        self._costs = {}

    def check_compatible(self, target: nn.Module, drafter: nn.Module) -> None:
        if self.policy is not None:
            self.policy.check_compatible(target, drafter)

    def prefill_state_indices(self) -> set[int] | None:
        return set() if self.policy is None else policy_state_indices(self.policy)

    def start(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> None:
        self.temperature = temperature
        if self.policy is not None:
            self.choose_with(self.policy, prefill_outputs, lm_head, temperature)

    def num_to_verify(self, drafted: DraftedRound) -> int:
        if drafted.num_drafts == 0:
            return 0
        acceptance = self.acceptance.per_slot(drafted)
        costs = self._round_costs(drafted.num_drafts + 1, acceptance.device)
        rate = expected_committed(acceptance.to(costs.device)) / costs
        return int(rate.argmax())  # the round's one host sync for the decision

    def _round_costs(self, width: int, device: torch.device) -> torch.Tensor:
        if width not in self._costs:
            cost_model = self.cost_model or CostModel.default_for(device)
            self._costs[width] = cost_model.round_ms_table(width, self.temperature, device)
        return self._costs[width]

    def describe(self) -> str:
        width = "policy" if self.policy is not None else f"b={self.fixed_block_size}"
        kind = "calibrated" if isinstance(self.acceptance, AcceptanceModel) else "entropy bound"
        return f"adaptive({width}, {kind})"


def _widest(policy: BlockSizePolicy) -> int:
    """The widest block `policy` may pick (until it has picked one)."""
    return check_block_size(max(max(getattr(policy, "candidates", None) or [16]), 2), "the policy's widest candidate")


def default_controller(drafter: nn.Module, max_slowdown: float | None = None) -> DraftController:
    """What `generate(assistant_model=drafter)` runs with no `draft_controller` ("default" in `bench` and the CLI):
    the drafter's policy under its `serving_controller` (`AdaptiveVerify`, or every draft verified), else its
    `block_size`; inside a `SpeculationGuard`, which turns drafting off where it loses to plain steps here.
    `max_slowdown` (e.g. 0.05; off by default): no request more than that much slower than plain decoding, at the
    cost of a few plain steps at each request's start (`SpeculationGuard`)."""
    policy = getattr(drafter, "policy", None)
    if policy is None:
        inner = DraftController(drafter.block_size)
    elif getattr(policy, "serving_controller", getattr(policy, "label_controller", "fixed")) == "adaptive":
        inner = AdaptiveVerify(policy=policy)
    else:
        inner = PolicyBlockSize(policy)
    return SpeculationGuard(inner, max_slowdown=max_slowdown)


def resolve_controller(drafter: nn.Module, controller: DraftController | int | None = None) -> DraftController:
    """The controller for one request: the one passed (an int is a fixed block size), else
    `default_controller(drafter)`."""
    if controller is None:
        return default_controller(drafter)
    if isinstance(controller, int) and not isinstance(controller, bool):
        return DraftController(controller)
    if not isinstance(controller, DraftController):
        raise TypeError(
            f"draft_controller must be a hf_blockpilot DraftController (e.g. AdaptiveVerify()) or a block size, "
            f"got {type(controller).__name__}"
        )
    return controller


class DelegatingController(DraftController):
    """A controller that wraps another: every decision is `inner`'s unless a subclass overrides it (the
    `SpeculationGuard`, the calibration's round recorder). Per-request copies copy `inner` too."""

    def __init__(self, inner: DraftController):
        if not isinstance(inner, DraftController):
            raise TypeError(f"{type(self).__name__} wraps a DraftController, got {type(inner).__name__}")
        super().__init__(inner.block_size)
        self.inner = inner
        self.cost_model = inner.cost_model

    @property
    def reads_confidence(self) -> bool:  # type: ignore[override]
        return self.inner.reads_confidence

    @property
    def chooses_verify_count(self) -> bool:  # type: ignore[override]
        return self.inner.chooses_verify_count

    def for_request(self) -> DelegatingController:
        fresh = copy.copy(self)
        fresh.inner = self.inner.for_request()
        fresh.reset()
        return fresh

    def check_compatible(self, target: nn.Module, drafter: nn.Module) -> None:
        self.inner.check_compatible(target, drafter)

    def use_cost_model(self, cost_model: CostModel) -> None:
        super().use_cost_model(cost_model)
        self.inner.use_cost_model(cost_model)

    def prefill_state_indices(self) -> set[int] | None:
        return self.inner.prefill_state_indices()

    def start(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> None:
        self.inner.start(prefill_outputs, lm_head, temperature)
        self.policy_probs, self.policy_seconds = self.inner.policy_probs, self.inner.policy_seconds

    def width(self) -> int:
        return self.inner.width()

    def max_width(self) -> int:
        return self.inner.max_width()

    def tau_curve(self) -> dict[int, float] | None:
        return self.inner.tau_curve()

    def num_to_verify(self, drafted: DraftedRound) -> int:
        return self.inner.num_to_verify(drafted)

    def observe(self, verified: int, accepted: int) -> None:
        self.inner.observe(verified, accepted)

    def describe(self) -> str:
        return self.inner.describe()


#: How far below plain steps' rate the speculation guard judges drafting before it pauses it. Pausing at break-even
#: paused requests whose early rounds were unlucky: on 344 held-out answers under 26 recorded cost tables (modeled),
#: 0.1 lifts the worst set from 0.94x to 0.98x the best fixed width and the mean from 1.066x to 1.069x, for a worst
#: prompt at 0.83x plain steps instead of 0.88x (docs/benchmarks.md, "The guard's pause margin").
PAUSE_MARGIN = 0.1


class SpeculationGuard(DelegatingController):
    """Wraps `inner` (its widths and verify budgets) and turns drafting off where it loses to plain steps.

    A request whose costs say drafting cannot pay even at `prior_acceptance` (per slot, geometric) decodes plain.
    Per round, committed tokens per second of recent drafting rounds (decayed by `decay`; the sums start from
    `prior_rounds` rounds at the prior acceptance, so the first round is judged without being trusted alone) are
    compared with a plain step's rate; more than `pause_margin` below it (a near tie is as likely noise or a
    pessimistic estimate as a loss, and a pause forgoes the rounds that would correct it), drafting pauses for
    `first_pause` plain rounds, doubling up to `max_pause` while probes keep losing. Where `inner` keeps evidence of
    the request's acceptance (`tau_curve`), rounds are judged by its corrected τ rather than their own counts.
    `timing="measured"` times rounds by the wall clock (overheads no cost model sees count), `"modeled"` by the cost
    model alone. In a batch one guard judges the shared rounds (`observe` hears the rows' mean verified and accepted
    drafts).

    `max_slowdown` (e.g. 0.05; default `None`: off) bounds the loss on every request, not only on average: a round
    drafts only if, were all its drafts rejected, the request's time so far (on the guard's clock, prefill excluded)
    would stay within `1 / (1 - max_slowdown)` of plain decoding's for the tokens committed so far plus one (each at
    a plain step's time); otherwise it is a plain step. A request thus starts with a few plain steps and drafts as
    the budget they earn, and the rounds that pay, allow (docs/benchmarks.md, "A per-request slowdown bound"). The
    decoding loop tells the guard the width each round drafted (the widest of a batch's rows), and a round is
    priced at it; without it, at the guard's own controller's width.
    """

    name = "guarded"

    def __init__(
        self,
        inner: DraftController,
        prior_acceptance: float = PRIOR_ACCEPTANCE,
        probe_rounds: int = 1,
        prior_rounds: float = 1.0,
        decay: float = 0.8,
        first_pause: int = 8,
        max_pause: int = 128,
        timing: str = "measured",
        clock: Callable[[], float] = time.perf_counter,
        max_slowdown: float | None = None,
        pause_margin: float = PAUSE_MARGIN,
    ):
        if (
            not 0.0 <= prior_acceptance <= 1.0
            or not 0.0 <= pause_margin < 1.0
            or not 0.0 <= decay < 1.0
            or probe_rounds < 1
            or first_pause < 1
            or prior_rounds < 0
        ):
            raise ValueError(
                "prior_acceptance in [0, 1], pause_margin in [0, 1), decay in [0, 1), probe_rounds >= 1, "
                "first_pause >= 1 and prior_rounds >= 0"
            )
        if timing not in ("measured", "modeled"):
            raise ValueError(f"timing must be 'measured' or 'modeled', got {timing!r}")
        check_max_slowdown(max_slowdown)
        super().__init__(inner)
        self.prior_acceptance = prior_acceptance
        self.probe_rounds = probe_rounds
        self.prior_rounds = prior_rounds
        self.decay = decay
        self.first_pause = first_pause
        self.max_pause = max(max_pause, first_pause)
        self.timing = timing
        self.clock = clock
        self.max_slowdown = max_slowdown
        self.pause_margin = pause_margin
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.temperature = 0.0
        self.plain_request = False
        self.paused_for = 0  # plain rounds left in the current pause
        self.next_pause = self.first_pause
        self.judged = 0  # drafting rounds since the last (re)start of drafting
        self.committed = self.seconds = self.rounds = 0.0  # decayed sums over those rounds
        self.modeled_seconds = 0.0  # the cost model's time of the same rounds, decayed alike
        self.plain_seconds: float | None = None  # a measured plain step (decayed mean), once a pause ran some
        self.last_width = 1
        self.last_time = 0.0
        self.spent = self.plain_equivalent = 0.0  # the request's seconds so far, and plain decoding's for its tokens
        self.evidence_source: DraftController | None = None  # whose `tau_curve` judges the rounds (`judge_by`)

    def start(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float) -> None:
        super().start(prefill_outputs, lm_head, temperature)
        self.begin(temperature, self.inner.width())

    def begin(self, temperature: float, width: int) -> None:
        """Start judging: the request decodes plain if drafting `width` slots (its first drafting width) cannot
        pay. A batch's guard starts here, its rows' own controllers having read their prefills
        (`hf_blockpilot.batched`)."""
        self.temperature = temperature
        self.plain_request = not self.speculation_can_pay(width)
        self._start_judging(width)
        self.last_time = self.clock()

    def _start_judging(self, width: int) -> None:
        """Drafting starts: the decayed sums hold only the prior (`prior_rounds` rounds of `width` slots, every
        draft verified, at the prior acceptance, on the cost model's clock)."""
        self.judged = 0
        self.committed = self.seconds = self.rounds = self.modeled_seconds = 0.0
        if self.cost_model is None or width <= 1:
            return
        self.rounds = self.prior_rounds
        self.committed = self.prior_rounds * geometric_tau(self.prior_acceptance, width)
        self.seconds = self.modeled_seconds = (
            self.prior_rounds * self.cost_model.round_ms(width, self.temperature) / 1000
        )

    def speculation_can_pay(self, width: int) -> bool:
        """Whether drafting `width` slots beats plain steps under the cost model, verified as the inner controller
        verifies: at the best count, at the prior acceptance, where it chooses one; else every draft, at the τ the
        inner controller expects (a τ policy's `tau_curve`) or else at the prior acceptance."""
        if width <= 1:
            return False
        if self.cost_model is None:
            return True
        plain_ms = self.cost_model.modeled_round_ms(1, 0, self.temperature)
        if self.inner.chooses_verify_count:
            rate = self.cost_model.tokens_per_ms(width, self.prior_acceptance, self.temperature)
        else:
            curve = self._tau_curve() or {}
            tau = curve.get(width, geometric_tau(self.prior_acceptance, width))
            rate = tau / max(self.cost_model.round_ms(width, self.temperature), 1e-9)
        return rate * plain_ms > 1.0

    def width(self) -> int:
        if self.plain_request or self.paused_for > 0:
            self.last_width = 1
        else:
            width = self.inner.width()
            self.last_width = width if width <= 1 or self._within_budget(width) else 1
        return self.last_width

    def _within_budget(self, width: int) -> bool:
        """Whether a round of `width` slots keeps the request within `max_slowdown` of plain decoding even if every
        draft is rejected (always, with no bound or no cost model to price the round)."""
        if self.max_slowdown is None or self.cost_model is None:
            return True
        plain = self._plain_step_seconds()
        worst = self.spent + self._drift() * self.cost_model.round_ms(width, self.temperature) / 1000
        return worst <= (self.plain_equivalent + plain) / (1.0 - self.max_slowdown)

    def max_width(self) -> int:
        return 1 if self.plain_request else self.inner.max_width()

    def observe(self, verified: float, accepted: float, width: int | None = None) -> None:
        """The outcome of a round; `width`: the slots it drafted where the caller drafted another width than
        `width()` gave (a batch's rows drafting their own controllers' widths), so it is priced at that width."""
        if width is not None and self.last_width > 1:
            self.last_width = width
        now = self.clock()
        elapsed, self.last_time = now - self.last_time, now
        modeled = 0.0
        if self.cost_model is not None:
            modeled = self.cost_model.modeled_round_ms(self.last_width, verified, self.temperature) / 1000
            if self.timing == "modeled":
                elapsed = modeled
            if self.max_slowdown is not None:
                self.spent += elapsed
                self.plain_equivalent += (accepted + 1) * self._plain_step_seconds()
        if self.last_width <= 1:  # a plain round: the request is plain, a pause is running down, or the budget held
            if self.paused_for > 0:
                self.paused_for -= 1
            if not self.plain_request:
                self._time_plain_step(elapsed)
            return
        self.inner.observe(verified, accepted)
        if self.cost_model is None:
            return
        self.committed = self.decay * self.committed + accepted + 1
        self.seconds = self.decay * self.seconds + elapsed
        self.modeled_seconds = self.decay * self.modeled_seconds + modeled
        self.rounds = self.decay * self.rounds + 1
        self.judged += 1
        if self.judged < self.probe_rounds:
            return
        as_plain = self._committed() * self._plain_step_seconds()  # plain steps' time for the tokens committed
        if as_plain < (1.0 - self.pause_margin) * self.seconds:  # clearly below break-even: pause, then probe
            self.paused_for, self.next_pause = self.next_pause, min(2 * self.next_pause, self.max_pause)
            self.judged = 0  # the probe is judged with the evidence so far, not the prior: one losing round ends it
        elif self.judged == self.probe_rounds:  # a probe (or the start) that pays: pauses start short again
            self.next_pause = self.first_pause

    def _committed(self) -> float:
        """The tokens the recent drafting rounds are judged to have committed (decayed): where the inner controller
        keeps evidence of the request's acceptance (`tau_curve`: a τ policy's prediction corrected by every round so
        far), its expected τ at the width drafted, per round; else the rounds' own counts, which a few unlucky
        rounds can sink."""
        curve = self._tau_curve()
        if curve is None or self.last_width not in curve:
            return self.committed
        return curve[self.last_width] * self.rounds

    def judge_by(self, controller: DraftController) -> None:
        """Judge rounds by `controller`'s evidence (`tau_curve`) rather than the guard's own inner copy's: a single
        request's own controller, which the decoding loop starts and its rounds correct (`hf_blockpilot.batched`)."""
        self.evidence_source = controller

    def _tau_curve(self) -> dict[int, float] | None:
        return (self.evidence_source or self.inner).tau_curve()

    def _time_plain_step(self, elapsed: float) -> None:
        if self.timing == "measured":
            last = self.plain_seconds
            self.plain_seconds = elapsed if last is None else self.decay * last + (1 - self.decay) * elapsed

    def _plain_step_seconds(self) -> float:
        """A plain step as measured in a pause; before any, the cost model's, scaled by how the drafting rounds'
        measured times compare with their modeled ones: a machine now slower or faster than when it was calibrated
        (another load, another clock) is judged in its own time, not partly in the calibration's."""
        if self.plain_seconds is not None:
            return self.plain_seconds
        return self._drift() * self.cost_model.modeled_round_ms(1, 0, self.temperature) / 1000

    def _drift(self) -> float:
        """How the drafting rounds' times compare with the cost model's (1: as modeled, or nothing drafted yet)."""
        return self.seconds / self.modeled_seconds if self.modeled_seconds > 0 else 1.0

    def describe(self) -> str:
        bound = "" if self.max_slowdown is None else f", max_slowdown={self.max_slowdown:g}"
        return f"guarded({self.inner.describe()}{bound})"
