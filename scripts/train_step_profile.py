"""Where one drafter training step's time goes: the embedded drafter fine-tuned on the embedded target's answers
(training-data/), hidden states precomputed (as offline states give them), 4 sequences a step, 32 anchors of 16.

    .venv/bin/python scripts/train_step_profile.py

Prints supervised tokens/s over 5 timed steps and a torch.profiler table of one step (self CPU time by op).
"""

from __future__ import annotations

import gzip
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_blockpilot.tools.loading import load_default_target, resolve_drafter
from hf_blockpilot.training.data import TrainingSequence, target_hidden_states
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig

DATA = "training-data/smollm2-135m-instruct-answers-seed7.jsonl.gz"


def main() -> None:
    target, _ = load_default_target(dtype=torch.float32)
    drafter = resolve_drafter(None).float()
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(64), f)]
    seqs = [TrainingSequence(r["id"], r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in rows]
    config = DrafterTrainingConfig(sequences_per_step=4, validation_fraction=0.0, max_steps=10**6, save_every=10**9)
    trainer = DrafterTrainer(drafter, target, seqs, None, "runs/train-step-profile", config)
    hidden = {s.id: target_hidden_states(target, [s], drafter.target_layer_ids)[0] for s in seqs}

    def step(batch: list[TrainingSequence]) -> None:
        states = torch.nn.utils.rnn.pad_sequence([hidden[s.id] for s in batch], batch_first=True)
        trainer.optimizer.zero_grad()
        loss, _ = trainer.batch_loss(batch, states, rng=random.Random(0))
        loss.backward()
        trainer.optimizer.step()

    rng = random.Random(1)
    batches = [rng.sample(seqs, 4) for _ in range(7)]
    step(batches[0])  # warm-up
    start, tokens = time.perf_counter(), 0
    for batch in batches[1:6]:
        step(batch)
        tokens += sum(len(s.supervised_tokens()) for s in batch)
    seconds = time.perf_counter() - start
    print(f"bf16 autocast {trainer.bf16}: {tokens / seconds:.0f} supervised tokens/s, {seconds / 5:.2f} s a step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batches[6])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
