"""τ of drafters on the held-out sets by replay: fast enough for every prompt on a 2-core CPU.

The target answers each prompt greedily once (cached as JSON lines); each drafter then drafts a block at every
position of those answers in a few batched forwards, and the rounds are chained as greedy speculative decoding
chains them (`DrafterTrainer.replay_acceptance`): a round anchored at a commits its accepted slots plus the
target's token. τ = response tokens / (1 prefill + rounds), pooled, as `hf-blockpilot eval-drafter` reports it.
It equals real decoding up to the rounding of the target's hidden states (one forward over the whole answer here,
verify forwards there); `eval-drafter` measures the same by decoding (compare the two on a few prompts).

    python scripts/replay_tau.py --drafters hf_blockpilot/assets/smollm2-135m-instruct-dflash runs/new \\
        --datasets humaneval mtbench --block-sizes 4 8 16 --max-new-tokens 96 --output runs/replay.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.data import load_prompts
from hf_blockpilot.tools.loading import resolve_target
from hf_blockpilot.training.data import generate_responses, read_sequences, target_hidden_states
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafters", nargs="+", required=True)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--block-sizes", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--responses-dir", default="runs/heldout-responses", help="cache of the target's answers")
    p.add_argument("--generation-batch-size", type=int, default=8)
    p.add_argument("--output", default=None)
    args = p.parse_args()

    target, tokenizer = resolve_target(None, dtype="float32")
    drafters = {path: BlockDiffusionDrafter.from_pretrained(path, dtype=torch.float32).eval() for path in args.drafters}
    report: dict = {"settings": vars(args), "tau": {}}
    for name in args.datasets:
        data = Path(args.responses_dir) / f"{name}-{args.max_new_tokens}"
        prompts = load_prompts(name, args.limit)
        generate_responses(
            target, tokenizer, prompts, data, args.generation_batch_size, args.max_new_tokens, 100_000, dtype=None
        )
        wanted = {record.id for record in prompts}
        sequences = [s for s in read_sequences(data) if s.id in wanted]
        layer_ids = next(iter(drafters.values())).target_layer_ids
        hidden = [
            target_hidden_states(target, [s], layer_ids, torch.float32)[0]
            for s in tqdm(sequences, desc=f"{name}: target hidden states")
        ]
        for path, drafter in drafters.items():
            for b in args.block_sizes:
                config = DrafterTrainingConfig(block_size=b, bf16=False, validation_fraction=0.0)
                with tempfile.TemporaryDirectory() as scratch:
                    trainer = DrafterTrainer(drafter, target, sequences, None, scratch, config)
                drafter.eval()
                tokens = forwards = 0
                for seq, states in zip(tqdm(sequences, desc=f"{name} {Path(path).name} b={b}"), hidden, strict=True):
                    rounds = trainer.replay_acceptance(seq, states)
                    tokens += len(seq.input_ids) - seq.response_start
                    forwards += 1 + len(rounds)
                tau = tokens / forwards
                report["tau"].setdefault(name, {}).setdefault(path, {})[b] = tau
                print(f"{name} ({len(sequences)} prompts) {path} b={b}: τ {tau:.3f}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
