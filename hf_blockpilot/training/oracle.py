"""Oracle block-size labels for BlockPilot, by replaying only the drafter.

At T=0 the target's continuation does not depend on the block size, and the target is causal: one plain
greedy decode gives the continuation, and one target forward over prompt + continuation gives every hidden
state any verify round would see. For each candidate b the drafter alone is then replayed round by round,
through the very candidate generator `generate()` uses, so the round count and τ(b) equal real decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from ..candidate_generator import BlockDiffusionCandidateGenerator
from ..datasets import PromptRecord
from ..evaluation import chat_inputs
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..policy import prefill_features
from ..stats import SpeculationStats
from .data import generation_eos_ids


def replay_block_size(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    hidden_states: Sequence[torch.Tensor],
    sequence: torch.LongTensor,
    prompt_len: int,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> SpeculationStats:
    """Statistics greedy decoding with `block_size` would have, from the target's states over `sequence`.

    `sequence` (1, n) is prompt + the target's greedy continuation; `hidden_states` the target's
    `hidden_states` tuple from one forward over it.
    """
    config = GenerationConfig(max_length=prompt_len + max_new_tokens, do_sample=False)
    config._eos_token_tensor = torch.tensor(list(eos_token_ids), device=sequence.device) if eos_token_ids else None
    generator = BlockDiffusionCandidateGenerator(
        drafter, target, sequence[:, :prompt_len], config, LogitsProcessorList()
    )
    generator.block_size = block_size
    generator.stats.block_size = block_size
    generator.get_candidates(sequence[:, :prompt_len], is_first_iteration=True)
    cur = prompt_len + 1  # prefill commits the first token
    generator.update_candidate_strategy(sequence[:, :cur], None, 0)
    while cur < sequence.shape[1]:
        seen = generator.cache.get_seq_length()
        outputs = SimpleNamespace(hidden_states=tuple(h[:, seen:] for h in hidden_states))
        candidates, _ = generator.get_candidates(sequence[:, :cur], model_outputs=outputs)
        drafts = candidates[0, cur:]
        truth = sequence[0, cur : cur + drafts.numel()]
        matches = int((drafts[: truth.numel()] == truth).int().cumprod(0).sum())
        cur = min(cur + matches + 1, sequence.shape[1])
        generator.update_candidate_strategy(sequence[:, :cur], None, matches)
    return generator.stats


@dataclass
class OracleRecord:
    """One prompt's labels: τ(b) and rounds(b) per candidate, and the policy features of its prefill."""

    id: str
    dataset: str
    prompt_tokens: int
    new_tokens: int
    tau: dict[int, float]
    rounds: dict[int, int]
    features: list[float]


@torch.inference_mode()
def oracle_record(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    record: PromptRecord,
    candidates: Sequence[int],
    feature_layers: Sequence[int],
    max_new_tokens: int,
) -> OracleRecord:
    """One plain greedy decode, one target forward, then a drafter replay per candidate block size."""
    input_ids = chat_inputs(tokenizer, record.prompt, target.device)
    prompt_len = input_ids.shape[1]
    sequence = target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    out = target(sequence, output_hidden_states=True)
    prefill = SimpleNamespace(
        hidden_states=tuple(h[:, :prompt_len] for h in out.hidden_states), logits=out.logits[:, prompt_len - 1 :]
    )
    features = prefill_features(prefill, list(feature_layers))[0]
    eos_ids = generation_eos_ids(target)
    tau, rounds = {}, {}
    for b in candidates:
        if b == 1:  # speculation off: one token per target forward
            tau[b], rounds[b] = 1.0, sequence.shape[1] - prompt_len
            continue
        stats = replay_block_size(target, drafter, out.hidden_states, sequence, prompt_len, b, max_new_tokens, eos_ids)
        tau[b], rounds[b] = stats.tau, stats.target_forwards
    return OracleRecord(
        id=record.id,
        dataset=record.dataset,
        prompt_tokens=prompt_len,
        new_tokens=sequence.shape[1] - prompt_len,
        tau=tau,
        rounds=rounds,
        features=features.float().cpu().tolist(),
    )


def collect_oracle_labels(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    output_dir: str | Path,
    candidates: Sequence[int],
    feature_layers: Sequence[int],
    max_new_tokens: int = 128,
    shard: int = 0,
    num_shards: int = 1,
) -> Path:
    """Append an `OracleRecord` per prompt to `output_dir/labels-<shard>.jsonl` (resumable, shardable).

    Prompts are split round-robin over `num_shards` processes; a manifest records the setup.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "candidates": list(candidates),
        "feature_layers": list(feature_layers),
        "max_new_tokens": max_new_tokens,
        "target": getattr(target.config, "_name_or_path", ""),
        "drafter": getattr(drafter.config, "_name_or_path", ""),
        "num_shards": num_shards,
    }
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    path = output_dir / f"labels-{shard:03d}.jsonl"
    done = {json.loads(line)["id"] for line in path.open()} if path.exists() else set()
    mine = [p for i, p in enumerate(prompts) if i % num_shards == shard and p.id not in done]
    with path.open("a") as f:
        for record in tqdm(mine, desc=f"oracle labels (shard {shard})", unit="prompt"):
            row = oracle_record(target, tokenizer, drafter, record, candidates, feature_layers, max_new_tokens)
            f.write(json.dumps(asdict(row)) + "\n")
            f.flush()
    return path


def read_oracle_labels(output_dir: str | Path) -> list[OracleRecord]:
    """All records of a collection directory (every shard); JSON keys of τ/rounds back to ints."""
    rows = []
    for path in sorted(Path(output_dir).glob("labels-*.jsonl")):
        for line in path.open():
            row = json.loads(line)
            row["tau"] = {int(k): v for k, v in row["tau"].items()}
            row["rounds"] = {int(k): v for k, v in row["rounds"].items()}
            rows.append(OracleRecord(**row))
    return rows


@torch.inference_mode()
def check_replay_against_decoding(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    candidates: Sequence[int],
    max_new_tokens: int,
) -> dict:
    """On a sample, decode for real once per b and compare with the replay: equality and the time saved."""
    import time

    from ..evaluation import timed_generate

    saved = drafter.block_size
    eos_ids = generation_eos_ids(target)
    equal, total, decode_seconds, replay_seconds = 0, 0, 0.0, 0.0
    try:
        for record in prompts:
            input_ids = chat_inputs(tokenizer, record.prompt, target.device)
            start = time.perf_counter()
            oracle_record(target, tokenizer, drafter, record, candidates, [0], max_new_tokens)
            replay_seconds += time.perf_counter() - start
            for b in candidates:
                if b == 1:
                    _, seconds = timed_generate(target, input_ids, max_new_tokens=max_new_tokens, do_sample=False)
                    decode_seconds += seconds
                    continue
                drafter.block_size = b
                out, seconds = timed_generate(target, input_ids, drafter, max_new_tokens=max_new_tokens, do_sample=False)
                decode_seconds += seconds
                real = drafter.last_stats
                hidden = target(out, output_hidden_states=True).hidden_states
                sim = replay_block_size(target, drafter, hidden, out, input_ids.shape[1], b, max_new_tokens, eos_ids)
                equal += sim.accepted_per_round == real.accepted_per_round and sim.tau == real.tau
                total += 1
    finally:
        drafter.block_size = saved
    return {
        "prompts": len(prompts),
        "checked": total,
        "equal": equal,
        "decode_seconds": decode_seconds,
        "replay_seconds": replay_seconds,
        "speedup": decode_seconds / max(replay_seconds, 1e-9),
    }
