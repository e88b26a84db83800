"""Batch-size benchmark: plain batched `generate` vs `generate(..., assistant_model=drafter)` at each batch size.

Each dataset's prompts are cut into batches of B (left padded, formatted as the per-prompt bench formats them);
every batch is decoded by both sides in the same process, timed alike. Writes `results.json`, `results.md` (a
table) and `throughput_vs_batch.png` (tokens/s against batch size, plain vs ours).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..custom_generate import prepare_controller
from ..data import chat_batch, load_prompts
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..stats import BatchSpeculationStats, SpeculationStats
from .bench import machine_info, machine_line, save_figure, save_report
from .evaluation import plain_in_other_dtypes, timed_call

#: Tokens each side decodes per warm-up call (untimed: lazy kernel set-up, the batch size's calibration).
WARM_UP_TOKENS = 4
#: The two sides of every comparison (and plain decoding in each other native dtype, `plain <dtype>`, after them).
SIDES = ("plain", "ours")


def run_batch_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    datasets: Sequence[str],
    batch_sizes: Sequence[int],
    temperatures: Sequence[float] = (0.0,),
    limit: int | None = None,
    max_new_tokens: int = 128,
    repeats: int = 1,
    output_dir: str | Path | None = None,
    choose_dtype: Callable[..., torch.dtype] | None = None,
) -> dict:
    """Plain batched `generate` against speculative `generate(**batch, assistant_model=drafter)` (the default
    controller) for every dataset x temperature x batch size; summarize and, with `output_dir`, save.

    Each dataset's prompts (the first `limit`) are cut into batches of B in file order (the last batch holds the
    rest), formatted with the chat template as the per-prompt bench does and left padded. Per batch, both sides
    run `repeats` times in turn (plain, ours, plain, ours, ...; the median time kept), under
    `torch.inference_mode`, on the wall clock (`timed_call`); the first batch of each row count is decoded once
    untimed beforehand. A row's tokens are its new tokens up to and including its first EOS (not the padding
    after it), counted alike on both sides; at T = 0 each row's tokens are compared with plain decoding's.
    `choose_dtype(target, drafter, B, prompt_tokens, new_tokens)`: the dtype both sides decode a dataset's batches
    of B rows in, given their median padded prompt length and `max_new_tokens` (copies of the pair; e.g.
    `preferred_dtype`); None: the pair's own.

    Returns the report: `machine` (`machine_info`), `settings`, and `runs`, one per (dataset, temperature,
    batch size) with its `dtype`, plain and ours tokens/s, `speedup` (ours / plain), plain tokens/s in every dtype
    of `decode_dtypes` (`plain_tokens_per_second_by_dtype`, copies of the target), the `fastest_plain` and
    `speedup_vs_fastest_plain`, greedy `mismatches` (rows; None at
    T > 0), the mean `tau` and `acceptance_length` over batches, `padded_slots` / `verify_slots` and their
    `padded_share`, and `per_batch` details.

    Raises:
        ValueError: a batch size below 1, no repeats, or a dataset with no prompts.
    """
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompts = {name: [record.prompt for record in load_prompts(name, limit)] for name in datasets}
    empty = [name for name, texts in prompts.items() if not texts]
    if empty:
        raise ValueError(f"no prompts in {', '.join(empty)} (limit={limit})")
    eos_ids = _eos_ids(target)
    pad_token_id = _pad_token_id(target, tokenizer, eos_ids)
    controller = prepare_controller(target, drafter, None, 1)  # what `generate` runs with no draft_controller
    # the target in each dtype plain decoding is timed in (the fastest plain configuration of the machine), made
    # once and shared: the pair of a batch size in one dtype, plain decoding's copies in the others
    plain_targets = {target.dtype: target} | {model.dtype: model for model in plain_in_other_dtypes(target).values()}
    pairs: dict[torch.dtype, tuple[PreTrainedModel, BlockDiffusionDrafter, dict[str, PreTrainedModel]]] = {}

    def pair_for(
        batches: list[dict[str, torch.Tensor]],
    ) -> tuple[PreTrainedModel, BlockDiffusionDrafter, dict[str, PreTrainedModel]]:
        dtype = target.dtype
        if choose_dtype is not None:
            padded = statistics.median(batch["input_ids"].shape[1] for batch in batches)
            dtype = choose_dtype(target, drafter, batches[0]["input_ids"].shape[0], int(padded), max_new_tokens)
        if dtype not in pairs:
            pair_target = plain_targets[dtype] if dtype in plain_targets else copy.deepcopy(target).to(dtype)
            pair_drafter = drafter if dtype == drafter.dtype else copy.deepcopy(drafter).to(dtype)
            others = {str(d).removeprefix("torch."): model for d, model in plain_targets.items() if d != dtype}
            pairs[dtype] = (pair_target, pair_drafter, others)
        return pairs[dtype]

    report: dict = {
        "machine": machine_info(target),
        "settings": {
            "datasets": list(datasets),
            "batch_sizes": list(batch_sizes),
            "temperatures": list(temperatures),
            "limit": limit,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "policy": drafter.policy is not None,
            "prompt_lookup": drafter.prompt_lookup,
            "controller": controller.describe(),
            "cost_model_source": controller.cost_model.source if controller.cost_model else None,
            "eos_token_ids": sorted(eos_ids),
            "pad_token_id": pad_token_id,
        },
        "runs": [],
    }
    total = len(temperatures) * sum(math.ceil(len(texts) / b) for texts in prompts.values() for b in batch_sizes)
    with tqdm(total=total, desc="batches", unit="batch") as progress:
        for temperature in temperatures:
            for name, texts in prompts.items():
                for batch_size in batch_sizes:
                    progress.set_postfix_str(f"{name} T={temperature:g} B={batch_size}")
                    batches = [
                        chat_batch(tokenizer, texts[i : i + batch_size], target.device, pad_token_id)
                        for i in range(0, len(texts), batch_size)
                    ]
                    pair_target, pair_drafter, other_plains = pair_for(batches)
                    torch.manual_seed(0)
                    run = decode_batches(
                        pair_target,
                        pair_drafter,
                        batches,
                        temperature,
                        max_new_tokens,
                        repeats,
                        eos_ids,
                        pad_token_id,
                        progress,
                        other_plains,
                    )
                    dtype = str(pair_target.dtype).removeprefix("torch.")
                    report["runs"].append(
                        {"dataset": name, "temperature": temperature, "batch_size": batch_size, "dtype": dtype, **run}
                    )
    if output_dir is not None:
        save_report(report, output_dir, batch_markdown_report, plot_throughput)
    return report


@torch.inference_mode()
def decode_batches(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    batches: Sequence[dict[str, torch.Tensor]],
    temperature: float,
    max_new_tokens: int,
    repeats: int,
    eos_ids: set[int],
    pad_token_id: int,
    progress: tqdm | None = None,
    other_plains: dict[str, PreTrainedModel] | None = None,
) -> dict:
    """Decode each batch (`input_ids` + `attention_mask`, left padded) with both sides, and plain decoding with
    each of `other_plains` (copies of the target in other dtypes, by name), and summarize; see
    `run_batch_benchmark` for how they are timed and counted."""
    gen = dict(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
    )
    if temperature > 0:
        gen["temperature"] = temperature
    sides = {"plain": (target, {}), "ours": (target, {"assistant_model": drafter})}
    sides |= {f"plain {name}": (model, {}) for name, model in (other_plains or {}).items()}
    # one-time costs (lazy kernel set-up; the calibration's batch axis at a new row count) stay out of the timing
    for batch in {len(batch["input_ids"]): batch for batch in reversed(batches)}.values():
        for model, extra in sides.values():
            model.generate(**batch, **extra, max_new_tokens=WARM_UP_TOKENS, do_sample=False, pad_token_id=pad_token_id)
    per_batch = []
    for batch in batches:
        runs: dict[str, list] = {side: [] for side in sides}
        for _ in range(repeats):  # interleaved: a slow spell of a noisy host hits every side alike
            for side, (model, extra) in sides.items():
                out, seconds = timed_call(partial(model.generate, **batch, **extra, **gen), model)
                runs[side].append((seconds, out.sequences, getattr(out, "speculation_stats", None)))
        medians = {side: sorted(runs[side], key=lambda run: run[0])[repeats // 2] for side in sides}
        (plain_seconds, plain_out, _), (ours_seconds, ours_out, stats) = (medians[side] for side in SIDES)
        prompt_length = batch["input_ids"].shape[1]
        plain_rows = row_tokens(plain_out, prompt_length, eos_ids)
        ours_rows = row_tokens(ours_out, prompt_length, eos_ids)
        stats = as_batch_stats(stats)
        per_batch.append(
            {
                "rows": len(plain_rows),
                "plain_seconds": plain_seconds,
                "ours_seconds": ours_seconds,
                "plain_tokens": sum(len(row) for row in plain_rows),
                "ours_tokens": sum(len(row) for row in ours_rows),
                "mismatches": sum(p != o for p, o in zip(plain_rows, ours_rows)) if temperature == 0 else None,
                "tau": stats.tau,
                "acceptance_length": stats.acceptance_length,
                "target_forwards": stats.target_forwards,
                "drafter_forwards": stats.drafter_forwards,
                "verify_slots": stats.verify_slots,
                "padded_slots": stats.padded_slots,
                "cost_model_source": stats.cost_model_source,
                "plain_by_dtype": {
                    str(sides[side][0].dtype).removeprefix("torch."): {
                        "seconds": seconds,
                        "tokens": sum(len(row) for row in row_tokens(out, prompt_length, eos_ids)),
                    }
                    for side, (seconds, out, _) in medians.items()
                    if side != "ours"
                },
            }
        )
        if progress is not None:
            progress.update(1)
    return summarize_batches(per_batch, temperature)


def summarize_batches(per_batch: Sequence[dict], temperature: float) -> dict:
    """Pooled tokens/s per side (tokens over seconds, all batches), speedup = ours / plain, greedy mismatches,
    mean τ and acceptance length over batches, padded share of the verified slots."""

    def total(key: str) -> float:
        return sum(b[key] for b in per_batch)

    plain_tps = total("plain_tokens") / max(total("plain_seconds"), 1e-9)
    ours_tps = total("ours_tokens") / max(total("ours_seconds"), 1e-9)
    by_dtype = {
        name: sum(b["plain_by_dtype"][name]["tokens"] for b in per_batch)
        / max(sum(b["plain_by_dtype"][name]["seconds"] for b in per_batch), 1e-9)
        for name in per_batch[0]["plain_by_dtype"]
    }
    fastest = max(by_dtype, key=by_dtype.get)
    return {
        "prompts": int(total("rows")),
        "batches": len(per_batch),
        "plain_tokens": int(total("plain_tokens")),
        "ours_tokens": int(total("ours_tokens")),
        "plain_seconds": total("plain_seconds"),
        "ours_seconds": total("ours_seconds"),
        "plain_tokens_per_second": plain_tps,
        "ours_tokens_per_second": ours_tps,
        "speedup": ours_tps / plain_tps if plain_tps > 0 else 0.0,
        "plain_tokens_per_second_by_dtype": by_dtype,
        "fastest_plain": fastest,
        "speedup_vs_fastest_plain": ours_tps / by_dtype[fastest] if by_dtype[fastest] > 0 else 0.0,
        "mismatches": int(total("mismatches")) if temperature == 0 else None,
        "tau": total("tau") / len(per_batch),
        "acceptance_length": total("acceptance_length") / len(per_batch),
        "verify_slots": int(total("verify_slots")),
        "padded_slots": int(total("padded_slots")),
        "padded_share": total("padded_slots") / max(total("verify_slots"), 1),
        "cost_model_source": per_batch[0]["cost_model_source"],
        "per_batch": list(per_batch),
    }


def row_tokens(sequences: torch.Tensor, prompt_length: int, eos_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens (after the `prompt_length` padded prompt columns) up to and including its first
    EOS: the padding a finished row carries until the batch ends is not counted."""
    rows = []
    for row in sequences[:, prompt_length:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def as_batch_stats(stats: BatchSpeculationStats | SpeculationStats) -> BatchSpeculationStats:
    """A call's statistics as a batch's: a one-row call (`generate`'s batch-1 path) returns `SpeculationStats`,
    whose verify rounds each sent the anchor and the verified drafts, with no padding."""
    if isinstance(stats, BatchSpeculationStats):
        return stats
    return BatchSpeculationStats(
        rows=[stats],
        batch_size=1,
        target_forwards=stats.target_forwards,
        drafter_forwards=stats.drafter_forwards,
        verify_slots=sum(drafted + 1 for drafted in stats.drafted_per_round),
        cost_model_source=stats.cost_model_source,
    )


def batch_markdown_report(report: dict) -> str:
    """One table: per dataset, temperature and batch size, the dtype, plain and ours tokens/s, speedup, the fastest
    plain configuration (plain in the same dtype or the other of `decode_dtypes`) and the speedup over it, τ, padded
    share of the verified slots and greedy mismatches."""
    lines = [
        machine_line(report),
        "",
        f"Batches of B prompts (left padded), {report['settings']['max_new_tokens']} new tokens at most per row; "
        "tokens counted per row up to its EOS; time: the median of "
        f"{report['settings']['repeats']} interleaved run(s) per batch, after a warm-up.",
        "",
        "| dataset | T | B | dtype | batches | plain tokens/s | ours tokens/s | speedup | fastest plain (tokens/s) "
        "| vs fastest plain | τ | padded / verified slots | greedy mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        mismatches = run["mismatches"] if run["mismatches"] is not None else "n/a"
        lines.append(
            f"| {run['dataset']} | {run['temperature']:g} | {run['batch_size']} | {run['dtype']} | {run['batches']} | "
            f"{run['plain_tokens_per_second']:.1f} | {run['ours_tokens_per_second']:.1f} | {run['speedup']:.2f}× | "
            f"{run['fastest_plain']} ({run['plain_tokens_per_second_by_dtype'][run['fastest_plain']]:.1f}) | "
            f"{run['speedup_vs_fastest_plain']:.2f}× | {run['tau']:.2f} | {100 * run['padded_share']:.1f}% | "
            f"{mismatches} |"
        )
    return "\n".join(lines) + "\n"


def plot_throughput(report: dict, output_dir: Path) -> list[Path]:
    """throughput_vs_batch.png: tokens/s against batch size, plain (dashed) and ours (solid), one pair of lines
    per dataset and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    groups: dict[tuple[str, float], list[dict]] = {}
    for run in report["runs"]:
        groups.setdefault((run["dataset"], run["temperature"]), []).append(run)
    for i, ((dataset, temperature), runs) in enumerate(groups.items()):
        runs = sorted(runs, key=lambda run: run["batch_size"])
        sizes = [run["batch_size"] for run in runs]
        color = f"C{i % 10}"
        label = f"{dataset} T={temperature:g}"
        ax.plot(sizes, [r["ours_tokens_per_second"] for r in runs], "o-", color=color, label=f"{label}: ours")
        ax.plot(sizes, [r["plain_tokens_per_second"] for r in runs], "s--", color=color, label=f"{label}: plain")
    batch_sizes = sorted({run["batch_size"] for run in report["runs"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.legend(fontsize=7)
    return [save_figure(fig, output_dir / "throughput_vs_batch.png")]


def _eos_ids(target: PreTrainedModel) -> set[int]:
    """The ids that end a row, as `generate` reads them (the target's generation config)."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _pad_token_id(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> int:
    """The id both sides pad with: the target's generation config's, else the tokenizer's, else an EOS id."""
    for candidate in (target.generation_config.pad_token_id, tokenizer.pad_token_id):
        if candidate is not None:
            return int(candidate)
    return min(eos_ids) if eos_ids else 0
