"""Calibrating the per-round controller: record each slot's draft confidence and whether it was accepted, then
fit `AcceptanceModel` (one logistic map per slot) to those rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..controllers import (
    AcceptanceModel,
    DelegatingController,
    DraftController,
    DraftedRound,
)

# one row per drafted slot: slot index (0 = first draft), confidence, entropy, lookup (0/1), label in [0, 1]
SlotRow = tuple[int, float, float, int, float]


class RoundRecorder(DelegatingController):
    """Wraps a controller (or a fixed block size) unchanged and records calibration rows from its rounds.

    Greedy rounds give hard labels: a slot is labelled if every draft before it was accepted (1 if it was
    accepted too, 0 if it was the first rejected one), so a row estimates P(accepted | prefix accepted). With
    `soft=True` the outcome is not read from `observe`; the caller passes the expected acceptance of each
    slot to `record_expected` instead (speculative sampling's sum of min(p, q)). Copies made per request
    share one `rows` list.
    """

    reads_confidence = True  # its rows need every round's confidences, whatever the wrapped controller reads

    def __init__(self, inner: DraftController | int, soft: bool = False):
        super().__init__(DraftController(inner) if not isinstance(inner, DraftController) else inner)
        self.soft = soft
        self.rows: list[SlotRow] = []
        self.pending: DraftedRound | None = None

    def reset(self) -> None:
        super().reset()
        self.pending = None

    def num_to_verify(self, drafted: DraftedRound) -> int:
        self.pending = drafted
        return self.inner.num_to_verify(drafted)

    def observe(self, verified: int, accepted: int) -> None:
        self.inner.observe(verified, accepted)
        if self.soft or self.pending is None:
            return
        labels = [1.0] * accepted + ([0.0] if accepted < verified else [])
        self._record(labels)

    def record_expected(self, acceptance: Sequence[float]) -> None:
        """Soft labels for the pending round: the probability each verified slot is accepted given the ones
        before it were."""
        if self.pending is not None:
            self._record([float(a) for a in acceptance])

    def _record(self, labels: list[float]) -> None:
        drafted, self.pending = self.pending, None
        if drafted.lookup:
            self.rows += [(slot, 1.0, 0.0, 1, label) for slot, label in enumerate(labels)]
            return
        confidence, entropy = drafted.confidence.tolist(), drafted.entropy.tolist()
        self.rows += [(slot, confidence[slot], entropy[slot], 0, label) for slot, label in enumerate(labels)]


def fit_acceptance_model(
    rows: Sequence[Sequence[float]], num_slots: int = 8, steps: int = 100, l2: float = 1e-3, min_rows: int = 20
) -> AcceptanceModel:
    """Per slot j < `num_slots` (later slots pooled into the last), a logistic regression of the label on
    logit(confidence) and entropy (binary cross-entropy, soft labels allowed, small L2); prompt-lookup slots
    get their mean label. Slots with fewer than `min_rows` rows reuse the previous slot's fit."""
    data = torch.tensor([list(r) for r in rows], dtype=torch.float64).reshape(-1, 5)
    if data.shape[0] == 0:
        raise ValueError("no calibration rows: collect labels (`hf-blockpilot collect`) to record rounds first")
    slot = data[:, 0].long().clamp(max=num_slots - 1)
    confidence = data[:, 1].clamp(1e-4, 1 - 1e-4)
    features = torch.stack([torch.log(confidence) - torch.log1p(-confidence), data[:, 2]], dim=1)
    lookup, label = data[:, 3] > 0.5, data[:, 4].clamp(0.0, 1.0)
    bias, conf_w, ent_w, lookup_rate = [], [], [], []
    for j in range(num_slots):
        mine = (slot == j) & ~lookup
        if int(mine.sum()) >= min_rows:
            weights = _logistic_fit(features[mine], label[mine], steps, l2)
            bias.append(weights[0]), conf_w.append(weights[1]), ent_w.append(weights[2])
        elif bias:
            bias.append(bias[-1]), conf_w.append(conf_w[-1]), ent_w.append(ent_w[-1])
        else:  # too few rows even for the first slot: the confidence taken at face value
            bias.append(0.0), conf_w.append(1.0), ent_w.append(0.0)
        looked = (slot == j) & lookup
        if int(looked.sum()) >= min_rows:
            lookup_rate.append(float(label[looked].mean()))
        elif lookup_rate:
            lookup_rate.append(lookup_rate[-1])
    while len(bias) > 1 and (bias[-1], conf_w[-1], ent_w[-1]) == (bias[-2], conf_w[-2], ent_w[-2]):
        bias.pop(), conf_w.pop(), ent_w.pop()  # trailing copies add nothing: later slots reuse the last
    while len(lookup_rate) > 1 and lookup_rate[-1] == lookup_rate[-2]:
        lookup_rate.pop()
    return AcceptanceModel(
        bias=bias,
        confidence_weight=conf_w,
        entropy_weight=ent_w,
        lookup_rate=lookup_rate or [0.6],
        rounds=int((data[:, 0] == 0).sum()),
    )


def _logistic_fit(features: torch.Tensor, label: torch.Tensor, steps: int, l2: float) -> list[float]:
    weights = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    design = torch.cat([torch.ones(features.shape[0], 1, dtype=torch.float64), features], dim=1)
    optimizer = torch.optim.LBFGS([weights], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(design @ weights, label)
        loss = loss + l2 * weights[1:].pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return [float(w) for w in weights.detach()]
