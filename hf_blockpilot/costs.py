"""What a speculative round costs on a device: the latency model that block sizes and verify budgets are
weighed against (measure one with `hf-blockpilot measure-cost`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .stats import SpeculationStats

ASSETS = Path(__file__).parent / "assets"
#: The per-slot acceptance assumed where a decision is made before any drafting (the guard, `--dtype auto`).
PRIOR_ACCEPTANCE = 0.5
#: A τ policy drafts only where its predicted rate beats plain decoding (b = 1) by this fraction at least, and by
#: its held-out τ error where that is larger (`drafting_margin`): a predicted tie is as likely a loss as a gain.
MIN_PREDICTED_GAIN = 0.05


def geometric_tau(acceptance: float, width: int) -> float:
    """Expected tokens a round drafting `width` slots commits (every draft verified, bonus included) when each
    draft is accepted with probability `acceptance` given the ones before it."""
    return sum(acceptance**i for i in range(width))


@dataclass
class CostModel:
    """Latency (ms) of speculative rounds: target forwards over n tokens, drafter forwards over b slots, and,
    when sampling, the work on vocabulary-sized rows of logits.

    `target_ms[n]` is a target forward over n tokens (n = 1: a plain decoding step); `drafter_ms[b]` one drafter forward
    over a block of b slots. The batch axis: `batch_target_ms[B][n]` / `batch_drafter_ms[B][b]` are the same forwards
    over B rows at once (see `for_batch`). `prefill_ms[B]`: plain `generate`'s prefill of B rows of `context_tokens`
    tokens each (see `prefill_estimate_ms`). Sizes between measured ones are interpolated linearly; sizes past the
    largest measured one extend its last slope. `inexact_rows`: verify forwards over these token counts were probed
    not to give plain decoding's logits bit for bit on this machine and dtype (`probe_exact_verify`; empty: lossless).
    `one_row_steps`: how a single request's one-token steps compute their one-row products, the fastest way the
    calibration timed (`exact_verify.ONE_ROW_STEPS`, all bit-equal: `"stock"`, `"split"` over the threads, or
    `"kernel"`, `row_kernel`); `target_ms[1]` is the step the loop then takes. `batch_steps[B]`: what runs a batch's
    one-token steps while its B rows are in lockstep, the faster the calibration timed: `"stock"` (the model itself,
    plain batched decoding's own forward) or `"view"` (the call's exact-path view, bit-equal, on faster kernels where
    probed so); `batch_target_ms[B][1]` is that step.
    At T>0, `sampling_process_ms` is the logits processors and a softmax on one row,
    `sampling_draw_ms` one multinomial draw from it (on a CPU the draw costs the most).
    """

    target_ms: dict[int, float]
    drafter_ms: dict[int, float]
    device: str = "cpu"
    context_tokens: int = 0
    sampling_process_ms: float = 0.0
    sampling_draw_ms: float = 0.0
    inexact_rows: list[int] = field(default_factory=list)  # verifies over these token counts round unlike plain
    one_row_steps: str = "stock"  # how a single request's one-token steps compute one-row products (calibrated)
    batch_target_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # batch size -> {tokens a row: ms}
    batch_drafter_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # batch size -> {slots a row: ms}
    batch_steps: dict[int, str] = field(default_factory=dict)  # batch size -> what runs its lockstep steps
    prefill_ms: dict[int, float] = field(default_factory=dict)  # batch size -> ms of a context_tokens-a-row prefill
    source: str = field(default="", compare=False)  # where the figures come from (calibration, fallback, file)

    def round_ms(self, block_size: int, temperature: float = 0.0) -> float:
        """A round that drafts `block_size` slots and verifies every draft (b = 1: a plain decoding step)."""
        return self.modeled_round_ms(block_size, block_size - 1, temperature)

    def verify_ms(self, num_tokens: int) -> float:
        """A target forward over `num_tokens` tokens (interpolated between measured sizes)."""
        return _interpolate(self.target_ms, num_tokens)

    def draft_ms(self, block_size: int) -> float:
        """A drafter forward over `block_size` slots (0 for b = 1, where nothing is drafted)."""
        return _interpolate(self.drafter_ms, block_size) if block_size > 1 and self.drafter_ms else 0.0

    def modeled_round_ms(self, width: int, verified: int, temperature: float = 0.0) -> float:
        """A round that drafts `width` slots (1: none) and sends `verified` drafts to the target.

        At T>0 it also processes 2k + 1 rows (k drafts, the target's k + 1 rows) and makes k + 1 draws (the k
        drafts, then the target's one token: a resample or the bonus); a plain sampling step is one of each.
        """
        ms = self.draft_ms(width) + self.verify_ms(verified + 1)
        if temperature > 0:
            ms += (2 * verified + 1) * self.sampling_process_ms + (verified + 1) * self.sampling_draw_ms
        return ms

    def tokens_per_ms(self, width: int, acceptance: float, temperature: float = 0.0) -> float:
        """Expected committed tokens per ms of a round drafting `width` slots, at the best verify count, when
        each draft is accepted with probability `acceptance` given the ones before it (width 1: a plain step)."""
        committed = [geometric_tau(acceptance, k + 1) for k in range(width)]
        return max(c / max(self.modeled_round_ms(width, k, temperature), 1e-9) for k, c in enumerate(committed))

    def modeled_decode_ms(self, stats: SpeculationStats, temperature: float = 0.0) -> float:
        """The modeled time of a whole request from its per-round statistics (the prefill counted as one
        plain step, alike for every method)."""
        return sum(
            self.modeled_round_ms(w, d, temperature)
            for w, d in zip(stats.widths_per_round, stats.drafted_per_round, strict=True)
        )

    def prefill_estimate_ms(self, prompt_tokens: int, batch_size: int = 1) -> float:
        """A prefill of `batch_size` rows of `prompt_tokens` tokens, interpolated in the batch's total tokens between
        a one-token forward (a plain step) and the timed prefills (a prefill's matrix products are over every row's
        tokens at once); with none timed, the verify forwards' last slope extended."""
        timed = {batch * self.context_tokens: ms for batch, ms in self.prefill_ms.items() if self.context_tokens}
        return _interpolate({1: self.target_ms[1]} | timed if timed else self.target_ms, batch_size * prompt_tokens)

    def request_ms(
        self,
        prompt_tokens: int,
        new_tokens: int,
        batch_size: int = 1,
        acceptance: float = 0.0,
        temperature: float = 0.0,
    ) -> float:
        """A whole request's expected time: its prefill, then `new_tokens` tokens a row at the best width's rate
        when each draft is accepted with probability `acceptance` (0: plain steps), sampling at `temperature`
        (T > 0: the sampling work of every round counted, `modeled_round_ms`)."""
        view = self.for_batch(batch_size)
        rate = max(view.tokens_per_ms(w, acceptance, temperature) for w in range(1, max(view.target_ms) + 1))
        return self.prefill_estimate_ms(prompt_tokens, batch_size) + new_tokens / rate

    def round_ms_table(self, block_size: int, temperature: float, device: torch.device | str = "cpu") -> torch.Tensor:
        """(b,) latency of a round that drafts `block_size` slots and verifies k = 0..b-1 of them."""
        costs = [self.modeled_round_ms(block_size, k, temperature) for k in range(block_size)]
        return torch.tensor(costs, dtype=torch.float32, device=device)

    def step_way(self, batch_size: int = 1) -> str:
        """What runs a one-token step of `batch_size` rows, the way the calibration timed it (its `target_ms[1]`, or
        `batch_target_ms[B][1]`): a single request's `one_row_steps`, a batch's `batch_steps` ("stock" if untimed)."""
        return self.one_row_steps if batch_size == 1 else self.batch_steps.get(batch_size, "stock")

    def for_batch(self, batch_size: int) -> CostModel:
        """The costs seen from one row of a batch of `batch_size` rows that all draft and verify alike: a round's
        forwards run over every row at once (a plain step is a batched one-token forward), and the sampling work
        is done per row. Batch sizes the calibration timed are used as timed; others are interpolated linearly
        between timed ones (batch size 1 is `target_ms`); with no batch timed, a forward over B rows of n tokens
        is charged as one over B * n tokens (the batch's total tokens)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size == 1:
            return self
        view = CostModel(
            target_ms=_batch_table(self.target_ms, self.batch_target_ms, batch_size),
            drafter_ms=_batch_table(self.drafter_ms, self.batch_drafter_ms, batch_size) if self.drafter_ms else {},
            device=self.device,
            context_tokens=self.context_tokens,
            sampling_process_ms=batch_size * self.sampling_process_ms,
            sampling_draw_ms=batch_size * self.sampling_draw_ms,
        )
        timed = "timed" if batch_size in self.batch_target_ms else "interpolated"
        view.source = f"{self.source}; batch of {batch_size} {timed if self.batch_target_ms else 'by total tokens'}"
        return view

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> CostModel:
        """Also reads files written before draws were timed apart: their `sampling_row_ms` (processing and a
        draw together) is charged per processed row, as it was then; and files from before the CPU verify kernels
        went (their `kernel_rows` are ignored) or before one-row steps took the row kernel (`split_one_row`)."""
        raw = dict(raw)
        raw["target_ms"] = {int(k): float(v) for k, v in raw["target_ms"].items()}
        raw["drafter_ms"] = {int(k): float(v) for k, v in raw["drafter_ms"].items()}
        raw.pop("kernel_rows", None)
        raw["inexact_rows"] = [int(n) for n in raw.get("inexact_rows", [])]
        raw["prefill_ms"] = {int(b): float(ms) for b, ms in raw.get("prefill_ms", {}).items()}
        raw["batch_steps"] = {int(b): str(way) for b, way in raw.get("batch_steps", {}).items()}
        for axis in ("batch_target_ms", "batch_drafter_ms"):
            raw[axis] = {int(b): {int(k): float(v) for k, v in t.items()} for b, t in raw.get(axis, {}).items()}
        if "split_one_row" in raw:
            raw["one_row_steps"] = "split" if raw.pop("split_one_row") else "stock"
        if "sampling_row_ms" in raw:
            raw["sampling_process_ms"] = raw.pop("sampling_row_ms")
        if 1 not in raw["target_ms"]:
            raise ValueError("a cost model needs target_ms[1], the latency of a plain decoding step")
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        cost = cls.from_dict(json.loads(Path(path).read_text()))
        cost.source = cost.source or f"file {path}"
        return cost

    @classmethod
    def default_for(cls, device: torch.device | str) -> CostModel:
        """The shipped cost model for a kind of device (the embedded pair timed on a 2-core x86 CPU, or on one
        H100); other pairs and devices should be timed with `hf-blockpilot measure-cost`."""
        kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
        cost = cls.load(ASSETS / f"cost_model_{kind}.json")
        cost.source = f"shipped fallback cost_model_{kind}.json (not this machine's)"
        return cost


def _batch_table(single: dict[int, float], batched: dict[int, dict[int, float]], batch_size: int) -> dict[int, float]:
    """Per size n, the cost of a forward over `batch_size` rows of n: timed, interpolated between timed batch
    sizes, or (none timed) that of one row of batch_size * n."""
    if batch_size in batched:
        return dict(batched[batch_size])
    if not batched:
        return {n: _interpolate(single, batch_size * n) for n in single}
    sizes = [n for n in single if all(n in table for table in batched.values())]
    return {n: _interpolate({1: single[n]} | {b: table[n] for b, table in batched.items()}, batch_size) for n in sizes}


def _interpolate(table: dict[int, float], size: int) -> float:
    if size in table:
        return table[size]
    sizes = sorted(table)
    if len(sizes) == 1:
        return table[sizes[0]]
    if size <= sizes[0]:
        lo, hi = sizes[0], sizes[1]
    elif size >= sizes[-1]:
        lo, hi = sizes[-2], sizes[-1]
    else:
        hi = next(s for s in sizes if s > size)
        lo = max(s for s in sizes if s < size)
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(table[lo] + slope * (size - lo), 0.0)
