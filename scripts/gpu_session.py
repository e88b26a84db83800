"""One time-boxed session on a lent GPU (issue 38): continue training the embedded drafter, then benchmark on CUDA.

Phases, each with an absolute deadline inside `--budget-seconds` (so a slow start shrinks the later ones, never
the whole run past its limit):
1. the target answers new prompts (greedy, bf16, batched): code prompts of stdlib seed `--seed`, then chat
   prompts of that seed; never HumanEval / MT-Bench / GSM8K;
2. the shipped drafter is fine-tuned on them with live target hidden states; every minute (and at the end) its
   bf16 weights are exported as shards under 16 MiB to `OUT/drafter` (what a lent machine can send back);
3. `hf-blockpilot bench` on CUDA, per held-out set (plain in every native dtype, fixed b, the policy), with the
   device's own calibration; results, logs and calibration tables go to `OUT/results.tar.gz`.

Run by `scripts/gpu_session.sh`; dry-run on a CPU with `--device cpu` and tiny budgets.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import torch

from hf_blockpilot.data import chat_training_prompts, stdlib_training_prompts
from hf_blockpilot.modeling_block_diffusion import BlockDiffusionDrafter
from hf_blockpilot.tools.loading import DEFAULT_DRAFTER_DIR, DEFAULT_POLICY_DIR, resolve_target
from hf_blockpilot.training.data import generate_responses, read_sequences
from hf_blockpilot.training.drafter import LOG_FILE, DrafterTrainer, DrafterTrainingConfig

SHARD_SIZE = "14MB"  # a lent machine sends back files of at most 16 MiB


def log(message: str) -> None:
    print(f"[gpu-session {time.strftime('%H:%M:%S')}] {message}", flush=True)


def export_drafter(drafter: BlockDiffusionDrafter, scratch: Path, dest: Path) -> None:
    """bf16 copy of `drafter`, sharded, copied file by file into `dest` (each file replaced atomically)."""
    shutil.rmtree(scratch, ignore_errors=True)
    state = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in drafter.state_dict().items()}
    drafter.save_pretrained(scratch, state_dict=state, max_shard_size=SHARD_SIZE)
    dest.mkdir(parents=True, exist_ok=True)
    for path in scratch.iterdir():
        shutil.copy2(path, dest / f".{path.name}.partial")
        os.replace(dest / f".{path.name}.partial", dest / path.name)


def pack_results(run: Path, out: Path) -> None:
    """Everything small worth keeping (logs, bench results, calibration tables) as one tar under `out`."""
    tmp = out / ".results.tar.gz.partial"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(run.rglob("*")):
            small = path.is_file() and path.stat().st_size < 4_000_000
            if small and path.suffix in {".json", ".jsonl", ".md", ".png", ".txt"} and "export" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(run)))
    os.replace(tmp, out / "results.tar.gz")


def train(args: argparse.Namespace, run: Path, out: Path, left) -> Path:
    """Phases 1 and 2; returns the trained drafter's folder."""
    start = time.monotonic()
    target, tokenizer = resolve_target(None, dtype="float32", device=args.device)
    log(f"target loaded ({time.monotonic() - start:.0f} s)")
    data = run / "data"
    if args.responses and not (data / "responses.jsonl").exists():  # answers generated earlier: no need to redo
        data.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.responses, "rb") as f, (data / "responses.jsonl").open("wb") as g:
            shutil.copyfileobj(f, g)
        log(f"seeded the data with {args.responses}")
    phases = [
        ("code", stdlib_training_prompts(args.code_prompts, seed=args.seed), args.code_until),
        ("chat", chat_training_prompts(args.chat_prompts, seed=args.seed), args.chat_until),
    ]
    for name, prompts, until in phases:
        seconds = left(until)
        if seconds > 0:
            tokens = generate_responses(
                target,
                tokenizer,
                prompts,
                data,
                args.generation_batch_size,
                args.max_new_tokens,
                max_seconds=seconds,
            )
            log(f"{name}: {tokens} response tokens ({time.monotonic() - start:.0f} s)")
    with (data / "responses.jsonl").open("rb") as f, gzip.open(out / ".responses.jsonl.gz.partial", "wb") as g:
        shutil.copyfileobj(f, g)  # the new data comes back too (for CPU-side training), if small enough
    if (out / ".responses.jsonl.gz.partial").stat().st_size < 15_000_000:
        os.replace(out / ".responses.jsonl.gz.partial", out / "responses.jsonl.gz")
    sequences = read_sequences(data)
    log(f"{len(sequences)} sequences, {sum(len(s.input_ids) - s.response_start for s in sequences)} response tokens")

    drafter = BlockDiffusionDrafter.from_pretrained(DEFAULT_DRAFTER_DIR, dtype=torch.float32).to(args.device)
    config = DrafterTrainingConfig(
        sequences_per_step=args.sequences_per_step,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        max_steps=args.warmup_steps,  # first leg; the schedule is then sized to the measured step rate
        save_every=10**9,
        save_every_minutes=1.0,
        eval_every=10**9,
        log_every=10,
        validation_fraction=0.02,
    )
    config.validation_max_sequences = args.validation_sequences
    trainer = DrafterTrainer(drafter, target, sequences, None, run / "train", config)
    before = trainer.evaluate()
    (run / "shipped_drafter_eval.json").write_text(json.dumps(before, indent=2))
    log(f"shipped drafter on the new held-out split: {before}")
    export = run / "export"
    trainer.train(on_save=lambda t: export_drafter(t.drafter, export, out / "drafter"))  # warm-up leg
    first_leg = trainer.step
    # timing leg: the schedule's horizon stays far (learning rate at its peak), time decides when it stops
    config.max_steps, config.max_minutes = 10**6, args.timing_seconds / 60
    trainer.train()
    records = [json.loads(line) for line in (run / "train" / LOG_FILE).open()]
    timed = [r for r in records if "seconds" in r and r["step"] > first_leg]
    rate = (timed[-1]["step"] - first_leg) / timed[-1]["seconds"] if timed else 1.0 / args.timing_seconds
    remaining = left(args.train_until)
    config.max_steps = trainer.step + max(0, int(rate * (remaining - 15)))  # ~15 s for the final evaluation
    config.max_minutes = max(remaining, 0) / 60
    log(f"{rate:.2f} steps/s: training to step {config.max_steps}")
    result = trainer.train(on_save=lambda t: export_drafter(t.drafter, export, out / "drafter"))
    log(f"trained: {result}")
    pack_results(run, out)

    final = run / "final"
    export_drafter(trainer.drafter.eval(), run / "export", final)
    return final


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder the lent machine sends back")
    p.add_argument("--run-dir", default="/tmp/gpu-session")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-seconds", type=float, default=540)
    p.add_argument("--code-until", type=float, default=110, help="seconds from start: stop answering code prompts")
    p.add_argument("--chat-until", type=float, default=170, help="seconds from start: stop answering chat prompts")
    p.add_argument("--train-until", type=float, default=375, help="seconds from start: stop training")
    p.add_argument("--bench-seconds", type=float, default=160, help="bench time, split over the datasets")
    p.add_argument("--code-prompts", type=int, default=12000)
    p.add_argument("--chat-prompts", type=int, default=12000)
    p.add_argument(
        "--seed", type=int, default=8, help="prompt generators' seed (the shipped drafter saw 0-2; training-data has 7)"
    )
    p.add_argument(
        "--responses",
        default=None,
        help="answers of an earlier window (a responses.jsonl.gz, e.g. in training-data/) to train on beside new ones",
    )
    p.add_argument("--generation-batch-size", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--sequences-per-step", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--timing-seconds", type=float, default=12, help="leg that measures the step rate")
    p.add_argument("--validation-sequences", type=int, default=64)
    p.add_argument("--bench-datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--bench-limit", type=int, default=3)
    p.add_argument("--bench-max-new-tokens", type=int, default=96)
    p.add_argument("--bench-repeats", type=int, default=1)
    p.add_argument("--bench-dtype", default="auto")
    args = p.parse_args()

    start = time.monotonic()

    def left(until: float) -> float:
        return min(until, args.budget_seconds) - (time.monotonic() - start)

    out, run = Path(args.out), Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
    }
    import transformers

    env["transformers"] = transformers.__version__
    (run / "env.json").write_text(json.dumps(env, indent=2))
    log(f"environment: {env}")

    try:
        final = train(args, run, out, left)
    except Exception:  # the bench still runs, with the shipped drafter
        log(f"training failed:\n{traceback.format_exc()}")
        final = DEFAULT_DRAFTER_DIR
    pack_results(run, out)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    datasets = args.bench_datasets
    for i, name in enumerate(datasets):
        seconds = min(left(args.budget_seconds) - 8, args.bench_seconds / len(datasets))
        if i == len(datasets) - 1:
            seconds = left(args.budget_seconds) - 8
        if seconds < 20:
            log(f"no time left to bench {name}")
            break
        command = [
            sys.executable,
            "-m",
            "hf_blockpilot",
            "bench",
            "--device",
            args.device,
            "--drafter",
            str(final),
            "--policy",
            str(DEFAULT_POLICY_DIR),
            "--datasets",
            name,
            "--limit",
            str(args.bench_limit),
            "--block-sizes",
            "4",
            "8",
            "16",
            "--temperatures",
            "0",
            "--repeats",
            str(args.bench_repeats),
            "--max-new-tokens",
            str(args.bench_max_new_tokens),
            "--no-baselines",
            "--dtype",
            args.bench_dtype,
            "--output-dir",
            str(run / f"bench-{name}"),
        ]
        log(f"bench {name} ({seconds:.0f} s at most): {' '.join(command)}")
        try:
            code = subprocess.run(command, timeout=seconds).returncode
            log(f"bench {name} exit {code}")
        except subprocess.TimeoutExpired:
            log(f"bench {name} stopped at its time limit")
        calibrations = Path(os.environ.get("HF_BLOCKPILOT_CACHE", run / "cache")) / "calibration"
        if calibrations.is_dir():
            shutil.copytree(calibrations, run / "calibration", dirs_exist_ok=True)
        pack_results(run, out)
    log(f"done in {time.monotonic() - start:.0f} s; log {LOG_FILE} and bench results in results.tar.gz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
