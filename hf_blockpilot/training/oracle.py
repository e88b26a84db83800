"""Oracle block-size labels for BlockPilot, by replaying only the drafter.

At T=0 the target's continuation does not depend on the block size, and the target is causal: one plain
greedy decode gives the continuation, and one target forward over prompt + continuation gives every hidden
state any verify round would see. For each candidate b the drafter alone is then replayed round by round,
through `generate`'s own decoding loop (`training.replay`), so the round count and τ(b) equal real decoding.

At T>0 one sampled continuation stands in for the target's output distribution, and acceptance is taken in
expectation instead of from one draw (`expected_sampled_stats`): speculative sampling accepts a draft drawn from
q with probability Σ_x min(p(x), q(x)) (Leviathan et al., 2023), with p and q the target's and the drafter's
processed distributions, so the expected number of rounds along the continuation follows by dynamic
programming, with no sampling noise from the acceptance draws.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..controllers import AcceptanceModel, AdaptiveVerify, DraftController
from ..costs import CostModel
from ..data import PromptRecord, chat_inputs
from ..device_calibration import sampling_processors
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..policy import checked_feature_layers, prefill_features
from ..stats import SpeculationStats
from .calibration import RoundRecorder
from .data import generation_eos_ids
from .replay import replay_decoder


def replay_block_size(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    hidden_states: Sequence[torch.Tensor],
    sequence: torch.LongTensor,
    prompt_len: int,
    controller: DraftController | int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> SpeculationStats:
    """Statistics greedy decoding with `controller` (or a fixed block size) would have, from the target's
    states over `sequence`.

    `sequence` (1, n) is prompt + the target's greedy continuation; `hidden_states` the target's
    `hidden_states` tuple from one forward over it: `generate`'s own loop runs on them (`replay_decoder`).
    """
    decoder = replay_decoder(
        target, drafter, hidden_states, sequence, prompt_len, controller, max_new_tokens, eos_token_ids
    )
    decoder.run()
    return decoder.call_stats


def expected_sampled_stats(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    hidden_states: Sequence[torch.Tensor],
    target_logits: torch.Tensor,
    sequence: torch.LongTensor,
    prompt_len: int,
    controller: DraftController | int,
    max_new_tokens: int,
    processors: LogitsProcessorList,
    eos_token_ids: Sequence[int] = (),
    cost: CostModel | None = None,
) -> tuple[float, float, float]:
    """Expected (τ, target forwards, modeled ms) of speculative sampling with `controller` (or a fixed block
    size) along a sampled `sequence`; ms is 0 without a `cost` model.

    `sequence` (1, n): prompt + one continuation sampled by the target; `hidden_states` and `target_logits`
    (1, n, V): the target's outputs of one forward over it. After c committed tokens the drafter drafts exactly
    as in real decoding (same context, same processed logits q_k per slot); slot k is accepted with probability
    α_k = Σ_x min(p_k(x), q_k(x)), p_k the target's processed distribution of that token given the continuation,
    so P(at least j accepted) = α_1 ··· α_j. The expected rounds R(c) = 1 + Σ_j P(j accepted) R(c + j + 1)
    are solved backwards. It assumes accepted drafts equal the continuation's tokens, which holds in
    distribution for the first slot and approximately after it; with top-k = 1 it equals the greedy replay.
    The controller must decide each round from that round alone (as `AdaptiveVerify` does): the recursion
    visits committed lengths, not histories. A `RoundRecorder(..., soft=True)` receives each round's α.
    """
    n = sequence.shape[1]
    target_probs = {}  # position -> the target's processed next-token distribution there
    survival = {}  # committed length c -> P(at least j drafts accepted), j = 1..k
    round_ms = {}  # committed length c -> modeled latency of the round drafted there

    def on_round(cur: int, width: int, draft_logits: torch.Tensor) -> list[float]:
        k = min(draft_logits.shape[0], n - cur)  # drafts past the end never count
        for pos in range(cur - 1, cur - 1 + k):
            if pos not in target_probs:
                target_probs[pos] = processors(sequence[:, : pos + 1], target_logits[:, pos].float())[0].softmax(-1)
        p = torch.stack([target_probs[pos] for pos in range(cur - 1, cur - 1 + k)]) if k else None
        alpha = torch.minimum(p, draft_logits[:k].softmax(-1)).sum(-1).clamp(max=1.0) if k else torch.zeros(0)
        survival[cur] = alpha.cumprod(0).tolist()
        round_ms[cur] = cost.modeled_round_ms(width, draft_logits.shape[0], 1.0) if cost else 0.0
        return alpha.tolist()

    replay_decoder(
        target,
        drafter,
        hidden_states,
        sequence,
        prompt_len,
        controller,
        max_new_tokens,
        eos_token_ids,
        processors,
        on_round,
    ).run()
    rounds, ms = [0.0] * (n + 1), [0.0] * (n + 1)
    for cur in range(n - 1, prompt_len, -1):
        at_least = [1.0] + survival[cur] + [0.0]
        exactly = [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]
        rounds[cur] = 1.0 + sum(e * rounds[min(cur + j + 1, n)] for j, e in enumerate(exactly))
        ms[cur] = round_ms[cur] + sum(e * ms[min(cur + j + 1, n)] for j, e in enumerate(exactly))
    forwards = 1.0 + rounds[prompt_len + 1]  # the prefill, then the verify rounds
    prefill_ms = cost.modeled_round_ms(1, 0, 1.0) if cost else 0.0
    return (n - prompt_len) / forwards, forwards, prefill_ms + ms[prompt_len + 1]


@dataclass
class OracleRecord:
    """One prompt's labels at one temperature: τ(b) and target forwards(b) per candidate (expected ones at
    T>0), and the policy features of its prefill."""

    id: str
    dataset: str
    prompt_tokens: int
    new_tokens: int
    tau: dict[int, float]
    rounds: dict[int, float]
    features: list[float]
    temperature: float = 0.0
    ms: dict[int, float] = field(default_factory=dict)  # modeled decoding time per candidate (with a cost model)
    controller: str = "fixed"  # what cut each round: "fixed" (every draft verified) or "adaptive"
    slot_rows: list[list[float]] = field(default_factory=list)  # calibration rows (see training.calibration)


@torch.inference_mode()
def oracle_record(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    record: PromptRecord,
    candidates: Sequence[int],
    feature_layers: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    cost: CostModel | None = None,
    acceptance: AcceptanceModel | None = None,
    adaptive: bool = False,
) -> OracleRecord:
    """One plain decode (greedy, or sampled at `temperature` with a seed from the prompt id), one target
    forward, then a drafter replay per candidate block size: every draft verified, or with `adaptive` cut
    each round by `AdaptiveVerify(b, acceptance, cost)` (labels of the composed system). The replays'
    rounds are recorded as calibration rows; with `cost`, each candidate's modeled decoding time too."""
    input_ids = chat_inputs(tokenizer, record.prompt, target.device, record.history)
    prompt_len = input_ids.shape[1]
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if temperature > 0:
        processors = sampling_processors(target, input_ids, temperature)
        torch.manual_seed(zlib.crc32(f"{record.id}@{temperature}".encode()))
    sequence = target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, **sampling
    )
    out = target(sequence, output_hidden_states=True)
    prefill = SimpleNamespace(hidden_states=tuple(h[:, :prompt_len] for h in out.hidden_states))
    features = prefill_features(prefill, list(feature_layers), target.get_output_embeddings(), temperature)[0]
    eos_ids = generation_eos_ids(target)
    if adaptive and cost is None:
        raise ValueError("adaptive labels weigh each round's verify budget by its cost: pass a cost model")
    new_tokens = sequence.shape[1] - prompt_len
    tau, rounds, ms, slot_rows = {}, {}, {}, []
    for b in candidates:
        if b == 1:  # speculation off: one token per target forward
            tau[b], rounds[b] = 1.0, new_tokens
            ms[b] = new_tokens * cost.modeled_round_ms(1, 0, temperature) if cost else 0.0
            continue
        inner = AdaptiveVerify(b, acceptance=acceptance, cost_model=cost) if adaptive else DraftController(b)
        recorder = RoundRecorder(inner, soft=temperature > 0)
        if temperature > 0:
            tau[b], rounds[b], ms[b] = expected_sampled_stats(
                target,
                drafter,
                out.hidden_states,
                out.logits,
                sequence,
                prompt_len,
                recorder,
                max_new_tokens,
                processors,
                eos_ids,
                cost,
            )
        else:
            stats = replay_block_size(
                target, drafter, out.hidden_states, sequence, prompt_len, recorder, max_new_tokens, eos_ids
            )
            tau[b], rounds[b] = stats.tau, stats.target_forwards
            ms[b] = cost.modeled_decode_ms(stats, temperature) if cost else 0.0
        slot_rows += [list(row) for row in recorder.rows]
    return OracleRecord(
        id=record.id,
        dataset=record.dataset,
        prompt_tokens=prompt_len,
        new_tokens=sequence.shape[1] - prompt_len,
        tau=tau,
        rounds=rounds,
        features=features.float().cpu().tolist(),
        temperature=temperature,
        ms=ms if cost else {},
        controller="adaptive" if adaptive else "fixed",
        slot_rows=slot_rows,
    )


def collect_oracle_labels(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    output_dir: str | Path,
    candidates: Sequence[int],
    feature_layers: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    shard: int = 0,
    num_shards: int = 1,
    temperatures: Sequence[float] = (0.0,),
    cost: CostModel | None = None,
    acceptance: AcceptanceModel | None = None,
    adaptive: bool = False,
) -> Path:
    """Append an `OracleRecord` per prompt and temperature to `output_dir/labels-<shard>.jsonl` (resumable,
    shardable).

    Prompts are split round-robin over `num_shards` processes; a manifest records the setup. The policy's
    features read the target layers `feature_layers` (default: `default_feature_layers(target)`). With `cost`,
    each record holds every candidate's modeled time; `adaptive` labels decoding under `AdaptiveVerify` (with
    `acceptance`, else its training-free entropy bound), i.e. the best drafting width *with* the controller.
    """
    feature_layers = checked_feature_layers(target, feature_layers)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "candidates": list(candidates),
        "feature_layers": list(feature_layers),
        "max_new_tokens": max_new_tokens,
        "target": getattr(target.config, "_name_or_path", ""),
        "drafter": getattr(drafter.config, "_name_or_path", ""),
        "prompt_lookup": drafter.prompt_lookup,  # replays go through the decoding generator, lookup rounds included
        "num_shards": num_shards,
        "temperatures": list(temperatures),
        "controller": "adaptive" if adaptive else "fixed",
        "acceptance_model": acceptance.to_dict() if acceptance is not None else None,
    }
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    path = output_dir / f"labels-{shard:03d}.jsonl"
    done = set()
    if path.exists():
        rows = [json.loads(line) for line in path.open()]
        done = {(row["id"], row.get("temperature", 0.0)) for row in rows}
    mine = [
        (p, t) for i, p in enumerate(prompts) if i % num_shards == shard for t in temperatures if (p.id, t) not in done
    ]
    with path.open("a") as f:
        for record, temperature in tqdm(mine, desc=f"oracle labels (shard {shard})", unit="label"):
            row = oracle_record(
                target,
                tokenizer,
                drafter,
                record,
                candidates,
                feature_layers,
                max_new_tokens,
                temperature,
                cost,
                acceptance,
                adaptive,
            )
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
            row["ms"] = {int(k): v for k, v in row.get("ms", {}).items()}
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

    from ..tools.evaluation import timed_generate

    eos_ids = generation_eos_ids(target)
    equal, total, decode_seconds, replay_seconds = 0, 0, 0.0, 0.0
    for record in prompts:
        input_ids = chat_inputs(tokenizer, record.prompt, target.device, record.history)
        start = time.perf_counter()
        oracle_record(target, tokenizer, drafter, record, candidates, [0], max_new_tokens)
        replay_seconds += time.perf_counter() - start
        for b in candidates:
            if b == 1:
                decode_seconds += timed_generate(
                    target, input_ids, max_new_tokens=max_new_tokens, do_sample=False
                ).seconds
                continue
            out, seconds, real = timed_generate(
                target, input_ids, drafter, max_new_tokens=max_new_tokens, do_sample=False, draft_controller=b
            )
            decode_seconds += seconds
            hidden = target(out, output_hidden_states=True).hidden_states
            sim = replay_block_size(target, drafter, hidden, out, input_ids.shape[1], b, max_new_tokens, eos_ids)
            equal += sim.accepted_per_round == real.accepted_per_round and sim.tau == real.tau
            total += 1
    return {
        "prompts": len(prompts),
        "checked": total,
        "equal": equal,
        "decode_seconds": decode_seconds,
        "replay_seconds": replay_seconds,
        "speedup": decode_seconds / max(replay_seconds, 1e-9),
    }
