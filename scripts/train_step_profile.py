"""Training throughput on this machine: the embedded drafter fine-tuned on the embedded target's answers
(training-data/), hidden states precomputed (as offline states give them), 4 sequences a step, 32 anchors of 16.

    .venv/bin/python scripts/train_step_profile.py                      # this tree: tokens/s and a profile
    git worktree add /tmp/hf-blockpilot-old <commit>
    .venv/bin/python scripts/train_step_profile.py --old /tmp/hf-blockpilot-old --out runs/train-ab.json

With `--old`, that checkout's trainer (imported as `hf_blockpilot_old`) runs beside this tree's in one process,
on the same batches and anchors, steps interleaved: supervised tokens/s of each, and the loss of each step (both
start from the same weights, so the first step's losses compare the loss per token of the two). Without it,
the floating-point operations of one step by op (torch's FlopCounterMode) and a torch.profiler table of
another run of that step (self CPU time by op) follow.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from hf_blockpilot.device_calibration import describe_device
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter
from hf_blockpilot.training.data import TrainingSequence, target_hidden_states

DATA = "training-data/smollm2-135m-instruct-answers-seed7.jsonl.gz"


def trainer_of(package, target, seqs, output_dir: str):
    """A trainer of `package` (this tree's `hf_blockpilot` or the old one) on the embedded drafter."""
    drafter = package.tools.loading.resolve_drafter(None).float()
    config = package.training.drafter.DrafterTrainingConfig(
        sequences_per_step=4, validation_fraction=0.0, max_steps=10**6, save_every=10**9
    )
    return package.training.drafter.DrafterTrainer(drafter, target, seqs, None, output_dir, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, default=None, help="a checkout (worktree) of the older commit")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per trainer")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    packages = {}
    if args.old is not None:
        from loop_ab_bench import import_old

        packages["old"] = import_old(args.old)
        import hf_blockpilot_old.tools.loading  # noqa: F401  (submodules the trainer needs)
        import hf_blockpilot_old.training.drafter  # noqa: F401
    import hf_blockpilot
    import hf_blockpilot.training.drafter  # noqa: F401

    packages["new"] = hf_blockpilot
    target, _ = load_default_target(dtype=torch.float32)
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(64), f)]
    seqs = [TrainingSequence(r["id"], r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in rows]
    layer_ids = resolve_drafter(None).target_layer_ids
    hidden = {s.id: target_hidden_states(target, [s], layer_ids)[0] for s in seqs}
    trainers = {
        name: trainer_of(package, target, seqs, f"runs/train-step-{name}") for name, package in packages.items()
    }

    def step(trainer, batch: list) -> float:
        states = torch.nn.utils.rnn.pad_sequence([hidden[s.id] for s in batch], batch_first=True)
        trainer.optimizer.zero_grad()
        loss, _ = trainer.batch_loss(batch, states, rng=random.Random(len(batch[0].input_ids)))
        loss.backward()
        trainer.optimizer.step()
        return loss.item()

    rng = random.Random(1)
    batches = [rng.sample(seqs, 4) for _ in range(args.steps + 2)]
    seconds = {name: [] for name in trainers}
    losses = {name: [] for name in trainers}
    for i, batch in enumerate(batches[: args.steps + 1]):  # the first step of each warms up, untimed
        for name, trainer in trainers.items():
            start = time.perf_counter()
            losses[name].append(step(trainer, batch))
            if i:
                seconds[name].append(time.perf_counter() - start)
    tokens = sum(len(s.supervised_tokens()) for batch in batches[1 : args.steps + 1] for s in batch)
    result = {
        "device": describe_device(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "bf16_autocast": trainers["new"].bf16,
        "steps": args.steps,
        "supervised_tokens": tokens,
        "trainers": {
            name: {
                "tokens_per_second": round(tokens / sum(seconds[name]), 1),
                "median_step_seconds": round(statistics.median(seconds[name]), 3),
                "losses": [round(value, 5) for value in losses[name]],
            }
            for name in trainers
        },
    }
    if "old" in trainers:
        result["new_over_old"] = round(sum(seconds["old"]) / sum(seconds["new"]), 3)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if "old" not in trainers:
        with FlopCounterMode(display=False) as counter:
            step(trainers["new"], batches[-1])
        flops = {str(op): count / 1e9 for op, count in counter.get_flop_counts()["Global"].items()}
        print("GFLOP in one step, by op:", json.dumps({op: round(g, 1) for op, g in flops.items()}))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(trainers["new"], batches[-1])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
