"""Measuring a drafter by real decoding: τ and tokens/s against plain `generate`, greedy equality checked."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .datasets import PromptRecord
from .modeling_block_diffusion import BlockDiffusionDrafter


def chat_inputs(tokenizer: PreTrainedTokenizerBase, prompt: str, device: torch.device | str) -> torch.Tensor:
    """Prompt ids (1, n) with the tokenizer's chat template applied when it has one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)


def timed_generate(
    target: PreTrainedModel, input_ids: torch.Tensor, drafter: BlockDiffusionDrafter | None = None, **kwargs
) -> tuple[torch.Tensor, float]:
    """`generate` with wall time (device synchronised); `drafter=None` runs plain decoding."""
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter, **kwargs)
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


@dataclass
class TauReport:
    """τ per block size over a prompt set (real greedy decoding), with equality to plain decoding."""

    dataset: str
    block_sizes: list[int]
    tau: dict[int, float] = field(default_factory=dict)
    acceptance_length: dict[int, float] = field(default_factory=dict)
    mismatches: dict[int, int] = field(default_factory=dict)
    prompts: int = 0
    new_tokens: int = 0


@torch.inference_mode()
def measure_tau(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    block_sizes: Sequence[int] = (4, 8, 16),
    max_new_tokens: int = 128,
) -> TauReport:
    """Decode every prompt greedily with each block size; τ = committed tokens / target forwards (pooled).

    Each output is compared with plain greedy `generate`; mismatches are counted, never hidden.
    """
    report = TauReport(dataset=prompts[0].dataset if prompts else "", block_sizes=list(block_sizes))
    totals = {b: [0, 0, 0.0, 0] for b in block_sizes}  # tokens, forwards, acceptance sum, rounds
    original = drafter.block_size
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    try:
        for record in tqdm(prompts, desc=f"tau on {report.dataset}", unit="prompt"):
            input_ids = chat_inputs(tokenizer, record.prompt, target.device)
            reference, _ = timed_generate(target, input_ids, **gen)
            report.new_tokens += reference.shape[1] - input_ids.shape[1]
            for b in block_sizes:
                drafter.block_size = b
                out, _ = timed_generate(target, input_ids, drafter, **gen)
                stats = drafter.last_stats
                report.mismatches[b] = report.mismatches.get(b, 0) + int(not torch.equal(out, reference))
                totals[b][0] += stats.new_tokens
                totals[b][1] += stats.target_forwards
                rounds = [a for a, d in zip(stats.accepted_per_round, stats.drafted_per_round) if d > 0]
                totals[b][2] += sum(a + 1 for a in rounds)
                totals[b][3] += len(rounds)
    finally:
        drafter.block_size = original
    report.prompts = len(prompts)
    for b, (tokens, forwards, acc, rounds) in totals.items():
        report.tau[b] = tokens / max(forwards, 1)
        report.acceptance_length[b] = acc / max(rounds, 1)
    return report
