"""Benchmark harness: plain `generate` vs each fixed block size vs BlockPilot vs the per-prompt oracle.

Writes `results.json` (machine info, per-prompt rows, summaries), `results.md` (tables) and PNG plots.
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import __version__
from ..controllers import DraftController
from ..costs import CostModel
from ..data import load_prompts
from ..device_calibration import cpu_description, describe_device
from ..modeling_block_diffusion import BlockDiffusionDrafter
from .evaluation import MethodResult, decode_methods, fastest_fixed_per_prompt, summarize_methods
from .reference_peer import ReferencePeer, peer_markdown, summarize_peers


def machine_info(target: PreTrainedModel) -> dict:
    """What the numbers were measured on: the device (CPU model and its matmul flags, or GPU name and
    capability), threads, dtype and library versions."""
    parameter = next(target.parameters())
    device = describe_device(parameter.device)
    return {
        "platform": platform.platform(),
        "cpu": device["name"] if device["device"] == "cpu" else cpu_description()[0],
        "cpu_threads": torch.get_num_threads(),
        "device": str(parameter.device),
        "device_name": device["name"],
        "device_flags": device["flags"],
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_blockpilot": __version__,
    }


def run_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    datasets: Sequence[str],
    block_sizes: Sequence[int],
    policy: object | None = None,
    temperatures: Sequence[float] = (0.0, 1.0),
    limit: int | None = None,
    max_new_tokens: int = 128,
    repeats: int = 3,
    output_dir: str | Path | None = None,
    controllers: Mapping[str, DraftController] | None = None,
    reference: bool = False,
    cost_model: CostModel | None = None,
    auto_dtype: bool = False,
) -> dict:
    """Decode every prompt of every dataset with every method (plain, each fixed b, the policy, each named
    controller) at every temperature; summarize and save.

    `reference`: also decode with the DFlash authors' loop side by side with ours at each fixed b
    (`tools.reference_peer`; needs `pip install --no-deps dflash==0.1.0`). `cost_model`: also time every
    method's rounds on the device's cost model (noise-free, decision overhead excluded) and, per fixed b at T = 0,
    the per-round verify oracle: how fast any per-round verify budget at that width could be. `auto_dtype`: also
    `auto`, the default in the dtype `generate --dtype auto` picks per prompt (see `decode_methods`)."""
    report: dict = {
        "machine": machine_info(target),
        "settings": {
            "datasets": list(datasets),
            "block_sizes": list(block_sizes),
            "temperatures": list(temperatures),
            "limit": limit,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "policy": policy is not None,
            "prompt_lookup": drafter.prompt_lookup,
            "controllers": {name: c.describe() for name, c in (controllers or {}).items()},
            "cost_model": cost_model.to_dict() if cost_model is not None else None,
            "cost_model_source": cost_model.source if cost_model is not None else None,
            "auto_dtype": auto_dtype,
        },
        "runs": [],
        "reference": [],
    }
    peer = ReferencePeer(drafter) if reference else None  # a missing package fails before any decoding
    prompt_sets = [(name, load_prompts(name, limit)) for name in datasets]  # read once, decoded at every temperature
    for temperature in temperatures:
        for name, prompts in prompt_sets:
            torch.manual_seed(0)
            results = decode_methods(
                target,
                tokenizer,
                drafter,
                prompts,
                block_sizes,
                policy,
                max_new_tokens,
                repeats,
                temperature,
                controllers,
                cost_model,
                auto_dtype,
            )
            report["runs"].append(
                {
                    "dataset": name,
                    "temperature": temperature,
                    "summary": summarize_methods(results),
                    "results": [asdict(r) for r in results],
                }
            )
            if peer is not None:
                peers = peer.compare(target, tokenizer, prompts, block_sizes, max_new_tokens, temperature, repeats)
                report["reference"].append(
                    {
                        "dataset": name,
                        "temperature": temperature,
                        "summary": summarize_peers(peers),
                        "results": [asdict(r) for r in peers],
                    }
                )
    if output_dir is not None:
        save_report(report, output_dir, markdown_report, plot_report)
    return report


def save_report(
    report: dict,
    output_dir: str | Path,
    markdown: Callable[[dict], str],
    plot: Callable[[dict, Path], object],
) -> Path:
    """Write `results.json`, `results.md` (`markdown(report)`) and the plots (`plot(report, output_dir)`)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(report, indent=2))
    (output_dir / "results.md").write_text(markdown(report))
    plot(report, output_dir)
    return output_dir


def machine_line(report: dict) -> str:
    """The line a results table opens with: what it was measured on (a report's `machine` and `settings`)."""
    machine, settings = report["machine"], report["settings"]
    return (
        f"Machine: {machine.get('device_name', machine['cpu'])} ({' '.join(machine.get('device_flags', []))}), "
        f"{machine['cpu_threads']} threads, device {machine['device']}, dtype {machine.get('dtype', '?')}, "
        f"torch {machine['torch']}, transformers {machine['transformers']}; costs: "
        f"{settings.get('cost_model_source') or 'none'}."
        + (" Prompt lookup on (every drafted method)." if settings["prompt_lookup"] else "")
    )


def markdown_report(report: dict) -> str:
    """Tables per dataset and temperature: tokens/s, speedup over plain, τ, mismatches, policy overhead; with a
    cost model, the modeled speedup and (fixed b, T = 0) the per-round verify oracle's."""
    lines = [machine_line(report), ""]
    for run in report["runs"]:
        modeled = any("modeled_speedup" in row for row in run["summary"].values())
        extra = " modeled speedup | per-round oracle, modeled |" if modeled else ""
        lines += [
            f"### {run['dataset']}, T={run['temperature']:g}",
            "",
            "| method | tokens/s | speedup | vs fastest plain | τ | drafts verified / round | greedy mismatches "
            "| policy overhead | per-round decision overhead |" + extra,
            "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if modeled else ""),
        ]
        for method, row in run["summary"].items():
            mismatches = row["mismatches"] if run["temperature"] == 0 else "n/a"
            line = (
                f"| {method} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}× | "
                f"{_ratio(row.get('speedup_vs_fastest_plain'))} | {row['tau']:.2f} | "
                f"{row.get('verified_per_round', 0.0):.2f} | {mismatches} | {100 * row['policy_overhead']:.2f}% | "
                f"{100 * row.get('controller_overhead', 0.0):.2f}% |"
            )
            if modeled:
                line += f" {_ratio(row.get('modeled_speedup'))} | {_ratio(row.get('round_oracle_speedup'))} |"
            lines.append(line)
        lines.append("")
        if "auto" in run["summary"]:
            ran_in = Counter(r.get("dtype") for r in run["results"] if r["method"] == "auto")
            lines += [
                "auto: the default in the dtype `generate --dtype auto` picks for each prompt (its length and "
                "the answer's budget; here " + ", ".join(f"{dtype} {n}x" for dtype, n in sorted(ran_in.items())) + "); "
                "its speedup is over plain in this table's dtype, its mismatches against plain in the dtype it ran in.",
                "",
            ]
        if modeled:
            lines += [
                "Modeled: the same rounds timed by the cost model in the settings (no host noise, decision "
                "overhead excluded). Per-round oracle: each round of that fixed b verifying only the drafts the "
                "target accepted, the bound on any per-round verify budget at that width.",
                "",
            ]
    for run in report.get("reference", []):
        lines += [
            f"### {run['dataset']}, T={run['temperature']:g}: ours vs the reference loop (`dflash_generate`), "
            "the drafter's full-vocabulary variant on both sides",
            "",
            peer_markdown(run["summary"]),
            "",
        ]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def plot_report(report: dict, output_dir: Path) -> list[Path]:
    """speedup.png (by method and dataset), block_sizes.png (chosen vs oracle b), tau.png (τ distribution)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(8, 4))
    runs = report["runs"]
    methods = list(dict.fromkeys(m for run in runs for m in run["summary"]))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        values = [run["summary"].get(m, {}).get("speedup", 0.0) for m in methods]
        ax.bar(
            [x + i * width for x in range(len(methods))],
            values,
            width,
            label=f"{run['dataset']} T={run['temperature']:g}",
        )
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(methods))], methods, rotation=30)
    ax.set_ylabel("speedup over plain generate")
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, output_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    for run in runs:
        rows = [MethodResult(**r) for r in run["results"]]
        chosen = {r.prompt_id: r.block_size for r in rows if r.method == "default"}
        for oracle in fastest_fixed_per_prompt(rows):
            if oracle.prompt_id in chosen:
                ax.scatter(oracle.block_size, chosen[oracle.prompt_id], alpha=0.5, s=15)
    ax.set_xlabel("oracle b (best measured tokens/s; 1 = plain)")
    ax.set_ylabel("widest b of the default (1 = plain)")
    paths.append(save_figure(fig, output_dir / "block_sizes.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in [m for m in methods if not m.startswith("plain") and m != "oracle"]:
        taus = [r["tau"] for run in runs for r in run["results"] if r["method"] == method]
        ax.hist(taus, bins=20, alpha=0.5, label=method)
    ax.set_xlabel("τ per prompt")
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, output_dir / "tau.png"))
    return paths


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
