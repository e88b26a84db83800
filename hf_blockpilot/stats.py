"""Per-request speculative decoding statistics: `generate(..., return_dict_in_generate=True)` returns them as
`output.speculation_stats`; `drafter.last_stats` is the latest call's (a convenience for one thread). A batched
call returns a `BatchSpeculationStats`, with one `SpeculationStats` per row."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class SpeculationStats:
    """What one `generate(..., assistant_model=drafter)` call did.

    Attributes:
        block_size: the width the request started drafting at (the fixed or policy-chosen b; 1 = speculation off).
        controller: the draft controller that decided widths and verify budgets.
        prompt_tokens: prompt length.
        new_tokens: tokens committed after the prompt.
        target_forwards: target forwards, prefill included.
        drafter_forwards: drafter forwards (one per drafted block).
        lookup_rounds: rounds drafted by prompt lookup instead (`drafter.prompt_lookup`).
        widths_per_round: slots drafted in each round (anchor included; 1 = nothing drafted).
        drafted_per_round: drafts sent to the target in each verify round (after the controller's cut).
        accepted_per_round: drafts accepted in each verify round (the bonus token not counted).
        policy_seconds: wall time spent choosing the block size.
        controller_seconds: wall time of the per-round verify decisions (confidences and the choice).
        policy_probs: the policy's score per candidate block size, when a policy chose it: its probability, or
            (a policy with objective "tau") its predicted τ(b).
        cost_model_source: where the costs the decisions weighed came from (this machine's calibration, a
            file, or a shipped fallback table).
    """

    block_size: int | None = None
    controller: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    lookup_rounds: int = 0
    widths_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    policy_seconds: float = 0.0
    controller_seconds: float = 0.0
    policy_probs: dict[int, float] | None = None
    cost_model_source: str = ""

    @property
    def plain_rounds(self) -> int:
        """Rounds after the prefill that verified no draft (speculation off, paused by the guard, or no room)."""
        return sum(1 for d in self.drafted_per_round[1:] if d == 0)

    @property
    def tau(self) -> float:
        """Tokens committed per target forward, bonus included (plain decoding: 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def committed_per_draft_round(self) -> list[int]:
        """Tokens committed (accepted drafts + bonus) by each verify round that carried drafts."""
        return [a + 1 for a, d in zip(self.accepted_per_round, self.drafted_per_round) if d > 0]

    @property
    def verified_per_round(self) -> float:
        """Mean drafts sent to the target per verify round that carried drafts."""
        return sum(self.drafted_per_round) / max(len(self.committed_per_draft_round), 1)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify round that carried drafts (accepted + bonus; DFlash's metric)."""
        rounds = self.committed_per_draft_round
        return sum(rounds) / len(rounds) if rounds else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tau"] = self.tau
        out["acceptance_length"] = self.acceptance_length
        return out


@dataclass
class BatchSpeculationStats:
    """What one batched `generate(..., assistant_model=drafter)` call did: `rows[i]` is row i's
    `SpeculationStats` (its own widths, drafts and acceptances, and the batched forwards it took part in);
    the totals describe the batch's forwards.

    Attributes:
        batch_size: rows in the call.
        target_forwards: batched target forwards, prefill included.
        drafter_forwards: batched drafter forwards.
        verify_slots: row x slot positions sent to the target after the prefill (finished rows excluded).
        padded_slots: of those, padding: slots of rows that verified fewer drafts than the round's widest.
        host_syncs: device-to-host transfers the loop waited for.
        cost_model_source: where the costs the decisions weighed came from.
    """

    rows: list[SpeculationStats]
    batch_size: int
    target_forwards: int = 0
    drafter_forwards: int = 0
    verify_slots: int = 0
    padded_slots: int = 0
    host_syncs: int = 0
    cost_model_source: str = ""

    @property
    def new_tokens(self) -> int:
        """Tokens committed over all rows."""
        return sum(row.new_tokens for row in self.rows)

    @property
    def tau(self) -> float:
        """Tokens committed per row per target forward that row took part in (plain decoding: 1.0)."""
        forwards = sum(row.target_forwards for row in self.rows)
        return self.new_tokens / forwards if forwards else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify round that carried drafts, over all rows."""
        rounds = [c for row in self.rows for c in row.committed_per_draft_round]
        return sum(rounds) / len(rounds) if rounds else 1.0

    def to_dict(self) -> dict[str, Any]:
        totals = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rows"}
        derived = {"new_tokens": self.new_tokens, "tau": self.tau, "acceptance_length": self.acceptance_length}
        return totals | derived | {"rows": [row.to_dict() for row in self.rows]}
