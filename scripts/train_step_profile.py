"""Where one drafter training step's time goes: the embedded drafter fine-tuned on the embedded target's answers
(training-data/), hidden states precomputed (as offline states give them), 4 sequences a step, 32 anchors of 16.

    .venv/bin/python scripts/train_step_profile.py

Prints supervised tokens/s over 5 timed steps and a torch.profiler table of one step (self CPU time by op).
"""

import gzip
import json
import random
import time

import torch

from hf_blockpilot.tools.loading import load_default_target, resolve_drafter
from hf_blockpilot.training.data import TrainingSequence, target_hidden_states
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig

torch.set_num_threads(2)
target, tok = load_default_target(dtype=torch.float32)
drafter = resolve_drafter(None).float()
rows = [
    json.loads(l) for _, l in zip(range(64), gzip.open("training-data/smollm2-135m-instruct-answers-seed7.jsonl.gz"))
]
seqs = [TrainingSequence(r["id"], r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in rows]
cfg = DrafterTrainingConfig(sequences_per_step=4, validation_fraction=0.0, max_steps=10**6, save_every=10**9)
trainer = DrafterTrainer(drafter, target, seqs, None, "runs/train-step-profile", cfg)
hidden = {s.id: target_hidden_states(target, [s], drafter.target_layer_ids)[0] for s in seqs}


def step(batch):
    h = torch.nn.utils.rnn.pad_sequence([hidden[s.id] for s in batch], batch_first=True)
    trainer.optimizer.zero_grad()
    loss, acc = trainer.batch_loss(batch, h, rng=random.Random(0))
    loss.backward()
    trainer.optimizer.step()
    return loss


rng = random.Random(1)
batches = [rng.sample(seqs, 4) for _ in range(8)]
step(batches[0])
t = time.perf_counter()
toks = 0
for b in batches[1:6]:
    step(b)
    toks += sum(len(s.supervised_tokens()) for s in b)
dt = time.perf_counter() - t
print(f"bf16={trainer.bf16} {toks / dt:.0f} supervised tok/s, {dt / 5:.2f} s/step")
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU]) as prof:
    step(batches[6])
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
