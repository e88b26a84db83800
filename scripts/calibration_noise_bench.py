"""Measured, then modeled: how far one calibration's cost table is from this machine's costs, and what the
difference costs the default (issue 39; docs/benchmarks.md "How noisy one calibration is").

    .venv/bin/python scripts/calibration_noise_bench.py --dtype bfloat16 --pool-repeats 60 --out runs/calibration-noise

1. Pool: `calibrate` once with `--pool-repeats` interleaved rounds, every timed call kept. The pool's medians are
   taken as this machine's costs ("pooled table").
2. Tables as a calibration of `r` repeats would record them (r in --repeats; the library calibrates with
   `CALIBRATION_REPEATS`, 5 before v20):
   `--tables-per-r` draws of r whole rounds from the pool, each function's median over them. Printed: the spread of
   the ratios decisions rest on (verify of n tokens / one-token step, drafter / step).
3. Modeled (the replay of `scripts/width_choice_bench.py`, its cached acceptance.json in --replay-dir): the default
   (`SpeculationGuard(PolicyBlockSize(policy))`) decides under each drawn table, its rounds costed under the pooled
   table; pooled over each set against the default deciding under the pooled table itself.
Writes results.json (the pool's samples too) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch
from width_choice_bench import decode, prefills

import hf_blockpilot.device_calibration as calibration
from hf_blockpilot.controllers import DraftController, PolicyBlockSize, SpeculationGuard
from hf_blockpilot.costs import CostModel
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy


def pooled_calibration(dtype: torch.dtype, repeats: int) -> tuple[CostModel, dict[str, list[float]]]:
    """One `calibrate` of `repeats` rounds, with every timed call of `_forward_ms` kept (warm-up dropped)."""
    target, _ = load_default_target(dtype=dtype)
    drafter = resolve_drafter(None, dtype)
    samples: dict[str, list[float]] = {}
    library_median = calibration.interleaved_median_ms

    def keeping(fns, rounds, device, progress=None):
        times = calibration.interleaved_times_ms(fns, rounds, device, progress)
        samples.update({json.dumps(key): t for key, t in times.items()})
        return {key: statistics.median(t) for key, t in times.items()}

    calibration.interleaved_median_ms = keeping  # this script's own process only
    try:
        cost = calibration.calibrate(target, drafter, repeats=repeats).cost_model
    finally:
        calibration.interleaved_median_ms = library_median
    return cost, samples


def drawn_table(pooled: CostModel, samples: dict[str, list[float]], rounds: list[int]) -> CostModel:
    """`pooled` with every timed entry the median over the given rounds of the pool."""
    median = {key: statistics.median(values[i] for i in rounds) for key, values in samples.items()}
    one_row = pooled.one_row_steps
    step = median[json.dumps(f"{one_row} step")] if one_row != "stock" else median[json.dumps(["target", 1])]
    return dataclasses.replace(
        pooled,
        target_ms={n: step if n == 1 else median[json.dumps(["target", n])] for n in pooled.target_ms},
        drafter_ms={n: median[json.dumps(["drafter", n])] for n in pooled.drafter_ms},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--pool-repeats", type=int, default=60)
    parser.add_argument("--repeats", type=int, nargs="+", default=[3, 5, 10, 20])
    parser.add_argument("--tables-per-r", type=int, default=12)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    parser.add_argument("--replay-dir", type=Path, default=Path("runs/wc"), help="width_choice_bench's --out")
    parser.add_argument("--out", type=Path, default=Path("runs/calibration-noise"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    pooled, samples = pooled_calibration(getattr(torch, args.dtype), args.pool_repeats)
    step = pooled.target_ms[1]
    print(
        f"pooled table ({args.pool_repeats} rounds): "
        + ", ".join(f"t({n}) {ms / step:.3f}" for n, ms in pooled.target_ms.items())
        + f"; drafter(4) {pooled.drafter_ms[4] / step:.3f} steps",
        flush=True,
    )
    rng = random.Random(0)
    draws = {
        r: [drawn_table(pooled, samples, rng.choices(range(args.pool_repeats), k=r)) for _ in range(args.tables_per_r)]
        for r in args.repeats
    }
    spread = {}
    for r, tables in draws.items():
        spread[r] = {}
        for n in [2, 3, 4, 8, 16]:
            ratios = [t.target_ms[n] / t.target_ms[1] for t in tables]
            spread[r][f"t({n})/t(1)"] = {"mean": statistics.mean(ratios), "sd": statistics.stdev(ratios)}
        line = ", ".join(f"{k} sd {v['sd']:.3f}" for k, v in spread[r].items())
        print(f"r = {r}: {line}", flush=True)

    acceptance = json.loads((args.replay_dir / "acceptance.json").read_text())
    target, tokenizer = load_default_target(dtype=torch.float32)
    policy = resolve_policy("default")
    states = prefills(SimpleNamespace(datasets=args.datasets, limit=None), target, tokenizer, [policy])
    lm_head = target.get_output_embeddings()
    rows = {d: {pid: acc for pid, acc in acceptance[d].items() if pid in states} for d in args.datasets}
    default = SpeculationGuard(PolicyBlockSize(policy), timing="modeled")

    def pooled_ms(controller: DraftController, decide: CostModel, dataset: str) -> float:
        return sum(
            decode(controller, acc, decide, states[pid], lm_head, truth=pooled) for pid, acc in rows[dataset].items()
        )

    reference = {d: pooled_ms(default, pooled, d) for d in args.datasets}
    best_fixed = {
        d: min(pooled_ms(DraftController(b), pooled, d) for b in policy.candidates if b > 1) for d in args.datasets
    }
    print(
        "default under the pooled table ÷ best fixed: "
        + ", ".join(f"{d} {best_fixed[d] / reference[d]:.3f}" for d in args.datasets),
        flush=True,
    )
    modeled = {}
    for r, tables in draws.items():
        modeled[r] = {d: [reference[d] / pooled_ms(default, t, d) for t in tables] for d in args.datasets}
        line = ", ".join(f"{d} mean {statistics.mean(v):.3f} worst {min(v):.3f}" for d, v in modeled[r].items())
        print(f"r = {r}: the default deciding under a drawn table ÷ under the pooled one: {line}", flush=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "settings": vars(args) | {"out": str(args.out), "replay_dir": str(args.replay_dir)},
                "machine": pooled.source,
                "pooled_table": pooled.to_dict(),
                "ratio_spread": spread,
                "default_vs_pooled_decisions": modeled,
                "default_under_pooled_vs_best_fixed": {d: best_fixed[d] / reference[d] for d in args.datasets},
                "samples_ms": samples,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
