"""Modeled: how the in-request width correction's prior and the fading of the policy's τ shape move the default
against the best fixed width, under every recorded cost table (issue 39 item 4; docs/benchmarks.md).

    .venv/bin/python scripts/correction_prior_bench.py --out runs/correction-prior

The default is `SpeculationGuard(PolicyBlockSize(policy))`: the policy's predicted τ per width, read as a per-slot
acceptance worth `prior_trials` slot trials, corrected by every round (`TauEvidence`), its shape (τ(b) over the
geometric fit) fading over `shape_trials` slot trials (None: kept). Each variant runs the replay of
`scripts/width_choice_bench.py` (its cached acceptance.json in --replay-dir, and the prefills, recomputed here) as
the default serves requests, with the guard timed by the cost model, and is summarized per table and set as its
pooled time against the best fixed width's. Prints one line per variant and writes results.json to --out.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch
from width_choice_bench import decode, prefills

from hf_blockpilot.controllers import DraftController, PolicyBlockSize, SpeculationGuard, TauEvidence
from hf_blockpilot.costs import CostModel
from hf_blockpilot.tools.loading import load_default_target, resolve_policy

#: name -> (prior_trials, shape_trials); None: the library's `PolicyBlockSize` as shipped.
VARIANTS: dict[str, tuple[float, float | None] | None] = {
    "shipped": None,
    "shape fades over 0.25 trials": (2.0, 0.25),
    "shape fades over 1 trial": (2.0, 1.0),
    "shape fades over 8 trials": (2.0, 8.0),
    "shape fades over 32 trials": (2.0, 32.0),
    "shape kept": (2.0, None),
    "prior 4 trials, shape 4": (4.0, 4.0),
    "prior 4 trials, shape 8": (4.0, 8.0),
}


class CorrectionVariant(PolicyBlockSize):
    """`PolicyBlockSize` whose request evidence fades the policy's shape over `shape_trials` slot trials."""

    def __init__(self, policy, prior_trials: float, shape_trials: float | None):
        super().__init__(policy, prior_trials=prior_trials)
        self.shape_trials = shape_trials

    def start(self, prefill_outputs, lm_head, temperature: float) -> None:
        super().start(prefill_outputs, lm_head, temperature)
        if self.evidence is not None:
            evidence = self.evidence
            self.evidence = TauEvidence(evidence.predicted, evidence.prior_trials, evidence.margin, self.shape_trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    parser.add_argument("--replay-dir", type=Path, default=Path("runs/wc"), help="width_choice_bench's --out")
    parser.add_argument("--out", type=Path, default=Path("runs/correction-prior"))
    parser.add_argument("--tables", nargs="+", default=["../shared/calibrations/*.json", "docs/calibrations/*.json"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    acceptance = json.loads((args.replay_dir / "acceptance.json").read_text())
    target, tokenizer = load_default_target(dtype=torch.float32)
    policy = resolve_policy("default")
    states = prefills(SimpleNamespace(datasets=args.datasets, limit=None), target, tokenizer, [policy])
    lm_head = target.get_output_embeddings()
    tables = {Path(p).stem: CostModel.load(p) for pattern in args.tables for p in sorted(glob.glob(pattern))}
    cells = [(table, dataset) for table in tables for dataset in args.datasets]
    rows = {d: {pid: acc for pid, acc in acceptance[d].items() if pid in states} for d in args.datasets}

    def pooled_ms(controller: DraftController, table: str, dataset: str) -> float:
        cost = tables[table]
        return sum(decode(controller, acc, cost, states[pid], lm_head) for pid, acc in rows[dataset].items())

    fixed = [b for b in policy.candidates if b > 1]  # the widths the policy chooses among, as width_choice_bench
    best_fixed = {cell: min(pooled_ms(DraftController(b), *cell) for b in fixed) for cell in cells}
    results = {}
    for name, variant in VARIANTS.items():
        corrected = PolicyBlockSize(policy) if variant is None else CorrectionVariant(policy, *variant)
        default = SpeculationGuard(corrected, timing="modeled")
        ratios = {f"{t} / {d}": best_fixed[(t, d)] / pooled_ms(default, t, d) for t, d in cells}
        values = sorted(ratios.values())
        worst = sorted(ratios, key=ratios.get)[:3]
        prior_trials, shape_trials = (corrected.prior_trials, corrected.prior_trials) if variant is None else variant
        results[name] = {"prior_trials": prior_trials, "shape_trials": shape_trials, "vs_best_fixed": ratios}
        print(
            f"{name}: >= 1.000 on {sum(v >= 0.9995 for v in values)} of {len(values)}, lowest {values[0]:.3f}, "
            f"median {statistics.median(values):.3f}; worst: "
            + ", ".join(f"{cell} {ratios[cell]:.3f}" for cell in worst),
            flush=True,
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
