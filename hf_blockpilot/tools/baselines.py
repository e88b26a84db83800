"""Per-round controllers from other systems, kept as the comparison set `bench` runs beside the default:
Transformers' heuristic schedule, dflash-mlx's acceptance EMA and AdaEDL's entropy stop. They plug into the same
seam as every controller (`DraftController`); the decoding core does not use them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..controllers import DraftController, DraftedRound, EntropyBound, check_block_size


class HeuristicSchedule(DraftController):
    """Transformers' `num_assistant_tokens_schedule="heuristic"` applied to the block: two more drafts after
    a round whose drafts were all accepted, one fewer otherwise (at least one)."""

    name = "heuristic"

    def __init__(self, start_block_size: int = 6, max_block_size: int = 16):
        super().__init__(check_block_size(max_block_size, "max_block_size"))
        self.start_block_size = min(check_block_size(start_block_size, "start_block_size"), max_block_size)
        self.current = self.start_block_size

    def reset(self) -> None:
        super().reset()
        self.current = self.start_block_size

    def width(self) -> int:
        return self.current

    def observe(self, verified: int, accepted: int) -> None:
        if verified == 0:
            return
        step = 2 if accepted == verified else -1
        self.current = min(max(self.current + step, 2), self.block_size)

    def describe(self) -> str:
        return f"heuristic(start={self.start_block_size}, max={self.block_size})"


class AcceptanceEMA(DraftController):
    """Block size following an exponential moving average of committed tokens per round (as dflash-mlx's
    adaptive block policy): draft one slot more than recent rounds committed."""

    name = "ema"

    def __init__(self, max_block_size: int = 16, decay: float = 0.7, start_block_size: int = 4):
        super().__init__(check_block_size(max_block_size, "max_block_size"))
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.start_block_size = min(check_block_size(start_block_size, "start_block_size"), max_block_size)
        self.average = float(self.start_block_size - 1)

    def reset(self) -> None:
        super().reset()
        self.average = float(self.start_block_size - 1)

    def width(self) -> int:
        return min(max(round(self.average) + 1, 2), self.block_size)

    def observe(self, verified: int, accepted: int) -> None:
        if verified:
            self.average = self.decay * self.average + (1 - self.decay) * (accepted + 1)

    def describe(self) -> str:
        return f"ema(max={self.block_size}, decay={self.decay})"


class EntropyStop(DraftController):
    """AdaEDL's stopping rule: verify drafts while the entropy bound on their acceptance stays >= `threshold`."""

    name = "entropy"
    reads_confidence = True
    chooses_verify_count = True

    def __init__(self, max_block_size: int = 16, gamma: float = 0.5, threshold: float = 0.4):
        super().__init__(check_block_size(max_block_size, "max_block_size"))
        self.bound = EntropyBound(gamma=gamma)
        self.threshold = threshold

    def num_to_verify(self, drafted: DraftedRound) -> int:
        if drafted.lookup:
            return drafted.num_drafts
        below = self.bound.per_slot(drafted) < self.threshold
        return int(torch.cat([below, below.new_ones(1)]).int().argmax())

    def describe(self) -> str:
        return f"entropy(max={self.block_size}, gamma={self.bound.gamma}, threshold={self.threshold})"


def baseline_controllers(block_sizes: Sequence[int], max_block_size: int = 16) -> dict[str, DraftController]:
    """The comparison set `bench` runs beside the policy and the adaptive controller."""
    out: dict[str, DraftController] = {f"b={b}": DraftController(b) for b in block_sizes}
    out["heuristic"] = HeuristicSchedule(max_block_size=max_block_size)
    out["ema"] = AcceptanceEMA(max_block_size=max_block_size)
    out["entropy"] = EntropyStop(max_block_size=max_block_size)
    return out
