"""Modeled benchmark of the per-request width choice: the embedded policy with and without the in-request
correction, every fixed width, the per-prompt oracle (each prompt at its own fastest fixed width or plain, in
hindsight) and plain decoding, on the held-out prompts, under every recorded cost table; and
the default with a per-request slowdown bound (`SpeculationGuard(max_slowdown=0.05)`) and with other pause margins
(`--pause-margins`; 0: the guard pauses drafting at break-even rather than at a clear loss).

Each held-out prompt's greedy answer is replayed once per drafting width (the drafts the target would accept at
every position, `DrafterTrainer.draft_acceptance`, float32); the library's own controllers then decode it round by
round (greedy: a round of width w anchored at position p commits its accepted drafts plus the target's token),
each round timed by the table. Prefill counted as one plain step on both sides. Acceptance is float32's; a
bfloat16 table prices the same rounds.

    .venv/bin/python scripts/width_choice_bench.py --responses-dir runs/heldout-responses --out runs/width-choice
    # candidate policies beside the embedded one ("default"), each served as the default serves it
    .venv/bin/python scripts/width_choice_bench.py --policies default new=runs/policy-new

Writes results.json and results.md to --out (the replay is cached there as acceptance.json: reruns take
seconds). Offline; on the 2-core EPYC the replay of 244 prompts x 7 widths takes about 15 minutes.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hf_blockpilot.controllers import DraftController, PolicyBlockSize, SpeculationGuard, policy_state_indices
from hf_blockpilot.costs import CostModel
from hf_blockpilot.data import load_prompts
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy
from hf_blockpilot.training.data import (
    MAX_PROMPT_TOKENS,
    chat_prompt_ids,
    generate_responses,
    read_sequences,
    target_hidden_states,
)
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig


def replay(args, target, tokenizer, drafter, widths: list[int]) -> dict:
    """{dataset: {prompt id: {"width": [accepted drafts at each answer position]}}}, cached in --out."""
    cache = args.out / "acceptance.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}
    trainers: dict[int, DrafterTrainer] = {}
    for dataset in args.datasets:
        prompts = load_prompts(dataset, args.limit)
        wanted = {p.id for p in prompts}
        table = done.setdefault(dataset, {})
        if wanted <= set(table):  # every answer replayed already: no responses needed
            continue
        data = args.responses_dir / f"{dataset}-{args.max_new_tokens}"
        generate_responses(target, tokenizer, prompts, data, 1, args.max_new_tokens, 10**9, dtype=None)
        for seq in (s for s in read_sequences(data) if s.id in wanted and s.id not in table):
            hidden = target_hidden_states(target, [seq], drafter.target_layer_ids, torch.float32)[0]
            table[seq.id] = {}
            stop = len(seq.input_ids) - 1
            for b in widths if not trainers else []:  # the replay's scoring, built once per width
                config = DrafterTrainingConfig(block_size=b, bf16=False, validation_fraction=0.0)
                trainers[b] = DrafterTrainer(drafter, target, [seq], None, args.out / "trainer", config)
            drafter.eval()
            begin = time.perf_counter()
            for b, trainer in trainers.items():
                table[seq.id][str(b)] = trainer.draft_acceptance(seq, hidden, 64, seq.response_start, stop)
            cache.write_text(json.dumps(done))
            seconds = time.perf_counter() - begin
            print(f"replayed {dataset} {seq.id} ({len(table)}/{len(wanted)}, {seconds:.1f} s)", flush=True)
    return done


def prefills(args, target, tokenizer, policies) -> dict:
    """{prompt id: the prefill outputs the policies read: the last logits and their hidden states (others
    dropped)}."""
    reads = [policy_state_indices(policy) for policy in policies]
    keep = None if None in reads else sorted({i for r in reads for i in r})
    out = {}
    for dataset in args.datasets:
        for record in load_prompts(dataset, args.limit):
            with torch.no_grad():
                ids = chat_prompt_ids(tokenizer, record, MAX_PROMPT_TOKENS)  # as the replayed answers were asked
                states = target(torch.tensor([ids], device=target.device), output_hidden_states=True)
            n = len(states.hidden_states)
            wanted = {i % n for i in keep} if keep is not None else set(range(n))
            out[record.id] = SimpleNamespace(
                hidden_states=[h if i in wanted else None for i, h in enumerate(states.hidden_states)],
                logits=states.logits[:, -1:],
            )
    return out


def decode(
    controller: DraftController,
    accepted: dict[str, list[int]],
    cost: CostModel,
    prefill,
    lm_head,
    truth: CostModel | None = None,
) -> float:
    """Modeled ms of one request decoded by `controller` along its replayed answer, the prefill as a plain step:
    the controller decides under `cost`, its rounds cost what `truth` says (default: `cost`)."""
    c = controller.for_request()
    c.use_cost_model(cost)
    c.start(prefill, lm_head, 0.0)
    truth = truth or cost
    n = len(next(iter(accepted.values())))
    anchor, ms = 0, truth.round_ms(1)
    while anchor < n:
        width = min(c.width(), n - anchor + 1)
        if width <= 1:
            verified, taken = 0, 0
        else:
            verified = width - 1
            taken = min(accepted[str(width)][anchor] if str(width) in accepted else 0, verified)
        ms += truth.modeled_round_ms(width, verified)
        c.observe(verified, taken)
        anchor += taken + 1
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--responses-dir", type=Path, default=Path("runs/heldout-responses"))
    parser.add_argument("--out", type=Path, default=Path("runs/width-choice"))
    parser.add_argument("--tables", nargs="+", default=["../shared/calibrations/*.json", "docs/calibrations/*.json"])
    parser.add_argument(
        "--pause-margins",
        type=float,
        nargs="*",
        default=[0.0],
        help="the default's guard also with these pause margins (the shipped one is `PAUSE_MARGIN`)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["default"],
        help="NAME=DIRECTORY (or 'default', the embedded policy): each served as the default serves it",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_default_target(dtype=torch.float32)
    drafter = resolve_drafter(None)
    policies = {spec.split("=")[0]: resolve_policy(spec.split("=")[-1]) for spec in args.policies}
    widths = sorted({b for policy in policies.values() for b in policy.candidates if b > 1})
    acceptance = replay(args, target, tokenizer, drafter, widths)
    states = prefills(args, target, tokenizer, list(policies.values()))
    lm_head = target.get_output_embeddings()
    tables = {Path(p).stem: CostModel.load(p) for pattern in args.tables for p in sorted(glob.glob(pattern))}
    methods = {f"b={b}": DraftController(b) for b in widths}
    for name, policy in policies.items():
        suffix = "" if name == "default" else f" [{name}]"
        methods |= {
            f"default{suffix}": SpeculationGuard(PolicyBlockSize(policy), timing="modeled"),
            f"default, uncorrected{suffix}": SpeculationGuard(
                PolicyBlockSize(policy, correct_width=False), timing="modeled"
            ),
            f"policy{suffix}": PolicyBlockSize(policy),
            f"default, max slowdown 5%{suffix}": SpeculationGuard(
                PolicyBlockSize(policy), timing="modeled", max_slowdown=0.05
            ),
        }
        methods |= {
            f"default, pause margin {m:g}{suffix}": SpeculationGuard(
                PolicyBlockSize(policy), timing="modeled", pause_margin=m
            )
            for m in args.pause_margins
        }
    served = [name for name in methods if name.startswith("default") and "uncorrected" not in name]
    results = {}
    for table_name, cost in tables.items():
        for dataset in args.datasets:
            # the prompts asked for (with --limit, the cached replay may hold more)
            rows = {pid: acc for pid, acc in acceptance[dataset].items() if pid in states}
            tokens = {pid: len(next(iter(acc.values()))) + 1 for pid, acc in rows.items()}
            plain = {pid: n * cost.round_ms(1) for pid, n in tokens.items()}
            cell, per_prompt = {}, {}
            for name, controller in methods.items():
                ms = {pid: decode(controller, acc, cost, states[pid], lm_head) for pid, acc in rows.items()}
                per_prompt[name] = ms
                cell[name] = {
                    "pooled_speedup": sum(plain.values()) / sum(ms.values()),
                    "median_speedup": statistics.median(plain[p] / ms[p] for p in ms),
                    "min_speedup": min(plain[p] / ms[p] for p in ms),
                }
            best = max((n for n in cell if n.startswith("b=")), key=lambda n: cell[n]["pooled_speedup"])
            cell["best fixed"] = {"name": best, **cell[best]}
            # the per-prompt oracle: each prompt at its own fastest fixed width (or plain), known in hindsight
            fixed = [times for name, times in per_prompt.items() if name.startswith("b=")]
            oracle = {pid: min(plain[pid], *(times[pid] for times in fixed)) for pid in rows}
            cell["per-prompt oracle"] = {"pooled_speedup": sum(plain.values()) / sum(oracle.values())}
            results.setdefault(table_name, {})[dataset] = {"prompts": len(rows), "methods": cell}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| cost table | set | prompts | best fixed | per-prompt oracle ÷ best fixed | "
        + " | ".join(f"{name} (min) | ÷ best fixed" for name in served)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(served),
    ]
    for table_name, per_set in results.items():
        for dataset, cell in per_set.items():
            m = cell["methods"]
            best = m["best fixed"]
            lines.append(
                f"| {table_name} | {dataset} | {cell['prompts']} | {best['name']} {best['pooled_speedup']:.2f}x | "
                f"{m['per-prompt oracle']['pooled_speedup'] / best['pooled_speedup']:.3f} | "
                + " | ".join(
                    f"{m[name]['pooled_speedup']:.2f}x ({m[name]['min_speedup']:.2f}x) "
                    f"| {m[name]['pooled_speedup'] / best['pooled_speedup']:.3f}"
                    for name in served
                )
                + " |"
            )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
