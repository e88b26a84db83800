"""Measuring a drafter by real decoding: τ and tokens/s against plain `generate`, greedy equality checked."""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import CompileConfig, PreTrainedModel, PreTrainedTokenizerBase

from .._compat import decode_dtypes
from ..controllers import (
    BlockSizePolicy,
    DraftController,
    PolicyBlockSize,
    default_controller,
)
from ..costs import CostModel
from ..data import PromptRecord, chat_inputs
from ..device_calibration import preferred_dtype, request_acceptance, timed
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..stats import SpeculationStats

T = TypeVar("T")


def timed_call(run: Callable[[], T], target: nn.Module) -> tuple[T, float]:
    """`run()` with wall time (the target's device synchronised), plain and speculative `generate` alike."""
    return timed(run, next(target.parameters()).device)


def _plain_compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=False, mode="default")
    config._compile_all_devices = True  # Transformers' own switch for compiling plain decoding off its GPU list
    return config


#: Plain `generate` compiled over a static cache, as Transformers runs it on a GPU (here on any device).
PLAIN_COMPILED = {"cache_implementation": "static", "compile_config": _plain_compile_config()}


class TimedRun(NamedTuple):
    """One timed `generate` call: its sequences, wall seconds and its own statistics (`None`: plain decoding)."""

    sequences: torch.Tensor
    seconds: float
    stats: SpeculationStats | None


def timed_generate(
    target: PreTrainedModel, input_ids: torch.Tensor, drafter: BlockDiffusionDrafter | None = None, **kwargs
) -> TimedRun:
    """`generate` with wall time (`timed_call`) and the call's `speculation_stats`; `drafter=None` runs plain
    decoding."""
    mask = torch.ones_like(input_ids)
    out, seconds = timed_call(
        lambda: target.generate(
            input_ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs
        ),
        target,
    )
    return TimedRun(out.sequences, seconds, getattr(out, "speculation_stats", None))


def plain_in_other_dtypes(target: PreTrainedModel) -> dict[str, PreTrainedModel]:
    """Copies of `target` in each dtype other than its own that decoding may be fastest in (`decode_dtypes`), by
    dtype name: what plain decoding is timed in to find the fastest plain configuration of the machine."""
    own = next(target.parameters()).dtype
    return {
        str(dtype).removeprefix("torch."): copy.deepcopy(target).to(dtype)
        for dtype in decode_dtypes(target.device)
        if dtype != own
    }


def compare_with_plain(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    drafter: BlockDiffusionDrafter,
    controller: DraftController,
    gen: dict,
    repeats: int,
    answer: torch.Tensor,
    compile: bool = False,
) -> dict:
    """Speculative decoding with `controller` against plain `generate` on one prompt, all sides timed alike:
    warmed, no streaming, `repeats` rounds in which every side runs once, back to back (the order reversed every
    other round, so no side always runs first); tokens/s are each side's median run, and each speedup is the median
    of the rounds' own ratios (a slow drift of the host's speed moves both sides of a round alike). Plain decoding
    is timed in the target's dtype (the lossless reference: `speedup`) and in every other dtype of
    `decode_dtypes`; the fastest of them is `fastest_plain` (`speedup_vs_fastest_plain`). `gen`: the generate
    arguments; `answer`: the output shown to the user (greedy: checked identical to plain too). `compile`: ours
    runs compiled, and plain decoding is also timed compiled over a static cache (`"<dtype> compiled"`); compile
    time stays in the warm-up."""
    own = str(next(target.parameters()).dtype).removeprefix("torch.")
    plains = {name: (model, {}) for name, model in ({own: target} | plain_in_other_dtypes(target)).items()}
    if compile:
        plains[f"{own} compiled"] = (target, PLAIN_COMPILED)
    ours_gen = dict(draft_controller=controller, compile=True) if compile else dict(draft_controller=controller)
    sides: dict[str, Callable[[dict], TimedRun]] = {
        OURS: lambda kwargs: timed_generate(target, input_ids, drafter, **ours_gen, **kwargs)
    }
    for name, (model, extra) in plains.items():
        sides[name] = lambda kwargs, model=model, extra=extra: timed_generate(model, input_ids, **extra, **kwargs)
    for run in sides.values():
        run(dict(max_new_tokens=8, do_sample=False))
    runs: dict[str, list[TimedRun]] = {name: [] for name in sides}
    for i in range(repeats):
        for name in list(sides)[:: 1 if i % 2 == 0 else -1]:
            runs[name].append(sides[name](gen))
    prompt = input_ids.shape[1]
    rates = {name: [(run.sequences.shape[1] - prompt) / run.seconds for run in each] for name, each in runs.items()}
    tps = {name: statistics.median(each) for name, each in rates.items() if name != OURS}
    fastest = max(tps, key=tps.get)
    out = _median_run(runs[OURS]).sequences
    plain_out = _median_run(runs[own]).sequences
    result = {
        "timed_runs": f"{repeats} per side, back to back in alternating order, no streaming, after a warm-up "
        "(tokens/s: median run; speedups: median of the per-round ratios)",
        "speculative_tokens_per_second": round(statistics.median(rates[OURS]), 2),
        "plain_tokens_per_second": round(tps[own], 2),
        "speedup": round(_paired_ratio(rates[OURS], rates[own]), 3),
        "plain_tokens_per_second_by_dtype": {name: round(value, 2) for name, value in tps.items()},
        "fastest_plain": fastest,
        "speedup_vs_fastest_plain": round(_paired_ratio(rates[OURS], rates[fastest]), 3),
    }
    if not gen["do_sample"]:
        result["identical_to_plain"] = bool(torch.equal(answer, plain_out)) and bool(torch.equal(out, plain_out))
    return result


#: `compare_with_plain`'s name for the speculative side.
OURS = "ours"


def _paired_ratio(ours: Sequence[float], plain: Sequence[float]) -> float:
    """The median over timing rounds of ours / plain tokens/s, each round's two runs taken back to back."""
    return statistics.median(a / b for a, b in zip(ours, plain, strict=True))


def _median_run(runs: list[TimedRun]) -> TimedRun:
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


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
    results = decode_methods(target, tokenizer, drafter, prompts, block_sizes, max_new_tokens=max_new_tokens)
    report.prompts = len(prompts)
    report.new_tokens = sum(r.new_tokens for r in results if r.method == "plain")
    for b in block_sizes:
        rows = [r for r in results if r.method == f"b={b}"]
        report.tau[b] = sum(r.new_tokens for r in rows) / max(sum(r.target_forwards for r in rows), 1)
        report.acceptance_length[b] = sum(r.committed_in_draft_rounds for r in rows) / max(
            sum(r.draft_rounds for r in rows), 1
        )
        report.mismatches[b] = sum(1 for r in rows if r.identical_to_plain is False)
    return report


def replay_tau(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    block_sizes: Sequence[int] = (4, 8, 16),
    max_new_tokens: int = 128,
    responses_dir: str | Path | None = None,
    generation_batch_size: int = 1,
) -> TauReport:
    """`measure_tau` by replay, an order of magnitude faster: the target answers each prompt greedily once
    (kept in `responses_dir`, reused by later calls; default a temporary folder), the drafter drafts a block at
    every position of the answers in batched forwards, and the rounds are chained as greedy speculative decoding
    chains them (`DrafterTrainer.replay_acceptance`). Equal to real decoding up to the rounding of the target's
    hidden states (one forward over the answer here, verify forwards there); τ only (no equality check:
    `mismatches` and `acceptance_length` stay empty). `generation_batch_size` > 1 answers faster, in
    left-padded batches, whose greedy answers can differ from single-prompt `generate` at near-ties. DFlash v1
    drafters with full-attention layers only."""
    from ..training.data import generate_responses, read_sequences, target_hidden_states
    from ..training.drafter import DrafterTrainer, DrafterTrainingConfig

    if drafter.config.is_dflash2 or drafter.config.has_masked_layers():
        raise ValueError(
            "τ by replay drafts as the trainer does: DFlash (v1) drafters with full, non-causal layers only; "
            "measure this drafter by decoding (eval-drafter without --replay)"
        )
    report = TauReport(dataset=prompts[0].dataset if prompts else "", block_sizes=list(block_sizes))
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(responses_dir) if responses_dir is not None else Path(scratch)
        generate_responses(
            target, tokenizer, prompts, data, generation_batch_size, max_new_tokens, max_prompt_tokens=10**9, dtype=None
        )
        wanted = {record.id for record in prompts}
        sequences = [s for s in read_sequences(data) if s.id in wanted]
        hidden = [target_hidden_states(target, [s], drafter.target_layer_ids, torch.float32)[0] for s in sequences]
        report.prompts = len(sequences)
        report.new_tokens = sum(len(s.input_ids) - s.response_start for s in sequences)
        training = drafter.training
        try:
            for b in block_sizes:
                config = DrafterTrainingConfig(block_size=b, bf16=False, validation_fraction=0.0)
                trainer = DrafterTrainer(drafter, target, sequences, None, Path(scratch) / "trainer", config)
                drafter.eval()
                rounds = [trainer.replay_acceptance(s, states) for s, states in zip(sequences, hidden, strict=True)]
                report.tau[b] = report.new_tokens / max(sum(1 + len(r) for r in rounds), 1)
        finally:
            drafter.train(training)
    return report


@dataclass
class MethodResult:
    """One prompt decoded by one method (`plain`, `b=<n>`, `policy`, `default` or a named controller)."""

    prompt_id: str
    method: str
    block_size: int | None
    new_tokens: int
    seconds: float
    tau: float
    identical_to_plain: bool | None
    policy_seconds: float = 0.0
    controller_seconds: float = 0.0  # per-round verify decisions
    target_forwards: int = 0  # prefill included; plain decoding: one per token
    draft_rounds: int = 0  # verify rounds that carried drafts
    committed_in_draft_rounds: int = 0  # tokens those rounds committed (accepted drafts + bonus)
    verified_drafts: int = 0  # drafts sent to the target, all rounds
    drafted_slots: int = 0  # slots the drafter drafted (or lookup copied), all rounds
    modeled_seconds: float | None = None  # the same rounds timed by the device's cost model (no host noise)
    round_oracle_seconds: float | None = None  # fixed b at T = 0: the per-round verify oracle, modeled
    dtype: str | None = None  # the dtype it decoded in

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@torch.inference_mode()
def decode_methods(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompts: Sequence[PromptRecord],
    block_sizes: Sequence[int],
    policy: BlockSizePolicy | None = None,
    max_new_tokens: int = 128,
    repeats: int = 1,
    temperature: float = 0.0,
    controllers: Mapping[str, DraftController] | None = None,
    cost_model: CostModel | None = None,
    auto_dtype: bool = False,
) -> list[MethodResult]:
    """Decode each prompt with plain `generate` (`plain`, and `plain <dtype>` for each other dtype of
    `decode_dtypes`), each fixed block size, the policy's widths with every draft
    verified (`policy`, if given), `default` (what `generate` runs with no `draft_controller`:
    `default_controller(drafter)`) and each named controller, every one passed per call as `draft_controller`
    (the drafter itself is left untouched). `auto_dtype`: also `auto`, the default in the dtype `generate --dtype
    auto` picks for each prompt (`preferred_dtype`, from its length, `max_new_tokens`, the temperature and the
    policy's predicted acceptance, `request_acceptance`), its output compared
    with plain in that dtype.

    Real end-to-end decoding (no recorded lookups); time is the median over `repeats`, taken round-robin over
    the methods; at T=0 every output is compared with plain `generate` in its own dtype. With a `cost_model`,
    every result also carries its rounds' modeled time, and each fixed b at T=0 the modeled time of the per-round
    verify oracle.
    """
    gen = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
    if temperature > 0:
        gen["temperature"] = temperature
    # plain decoding in the target's dtype (the lossless reference) and in every other dtype it may be fastest in
    others = plain_in_other_dtypes(target)
    plains = {"plain": target} | {f"plain {name}": model for name, model in others.items()}
    methods: dict[str, DraftController] = {f"b={b}": DraftController(b) for b in block_sizes}
    if policy is not None:
        methods["policy"] = PolicyBlockSize(policy)
    methods["default"] = default_controller(drafter)
    methods.update(controllers or {})
    # per method: the dtype it decodes in, and the plain method its output must equal at T = 0 (other dtypes'
    # plains: none, their outputs differ); per dtype: the plain method in it, and (auto) the pair in it with its
    # default controller
    ran_in = {name: next(model.parameters()).dtype for name, model in plains.items()}
    ran_in |= dict.fromkeys(methods, next(target.parameters()).dtype)
    reference = dict.fromkeys(["plain", *methods], "plain")
    plain_in = {dtype: name for name, dtype in ran_in.items() if name in plains}
    pairs = {next(target.parameters()).dtype: (target, drafter)}
    if auto_dtype:
        pairs |= {model.dtype: (model, copy.deepcopy(drafter).to(model.dtype)) for model in others.values()}
    auto = {dtype: default_controller(pair[1]) for dtype, pair in pairs.items()} if auto_dtype else {}
    # first calls pay one-time costs of their own (a policy's, the calibration's): warm those paths untimed
    warm = [(target, drafter, c) for c in (methods.get("policy"), methods["default"]) if c is not None]
    warm += [(*pairs[dtype], controller) for dtype, controller in auto.items()]
    results = []
    for record in tqdm(prompts, desc="decoding", unit="prompt"):
        input_ids = chat_inputs(tokenizer, record.prompt, target.device, record.history)
        calls: dict[str, Callable[[], TimedRun]] = {
            name: functools.partial(timed_generate, model, input_ids, **gen) for name, model in plains.items()
        }
        calls |= {
            name: functools.partial(timed_generate, target, input_ids, drafter, draft_controller=controller, **gen)
            for name, controller in methods.items()
        }
        if auto_dtype:
            dtype = preferred_dtype(
                target,
                drafter,
                prompt_tokens=input_ids.shape[1],
                new_tokens=max_new_tokens,
                copies=pairs,
                temperature=temperature,
                acceptance=request_acceptance(target, drafter, input_ids, temperature),
            )
            pair_target, pair_drafter = pairs[dtype]
            calls["auto"] = functools.partial(
                timed_generate, pair_target, input_ids, pair_drafter, draft_controller=auto[dtype], **gen
            )
            reference["auto"], ran_in["auto"] = plain_in[dtype], dtype
        # Warm-up of every path, so one-time costs (lazy kernel set-up on CUDA) are not timed.
        for model in plains.values():
            timed_generate(model, input_ids, max_new_tokens=4, do_sample=False)
        for model, model_drafter, controller in warm:
            timed_generate(
                model, input_ids, model_drafter, max_new_tokens=4, do_sample=False, draft_controller=controller
            )
        # Repeat r of every method runs before repeat r + 1 of any: a slow spell of a noisy host then hits
        # all methods alike instead of whichever was being timed.
        runs: dict[str, list[TimedRun]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                runs[name].append(call())
        medians = {name: _median_run(runs[name]) for name in calls}
        for name, (out, seconds, stats) in medians.items():
            plain = medians[reference[name]].sequences if name in reference else None
            results.append(
                method_result(
                    record.id,
                    name,
                    out,
                    input_ids.shape[1],
                    seconds,
                    stats,
                    plain,
                    temperature,
                    cost_model if name != "auto" else None,  # the cost model is of the target's dtype
                    fixed=name.startswith("b="),
                    dtype=ran_in[name],
                )
            )
    return results


def round_oracle_ms(cost_model: CostModel, stats: SpeculationStats) -> float:
    """The modeled greedy time of the same request had every round verified only as many of its drafts as the
    target then accepted (or the cheapest larger count: verify latency is not monotonic on every device), at the
    same drafting widths: what a per-round verify controller that knew each outcome would take.

    At T = 0 verifying any count from the accepted one up commits the same tokens, so the request's rounds are
    unchanged and this bounds every per-round verify budget at these widths from below."""
    return sum(
        cost_model.draft_ms(w) + min(cost_model.verify_ms(k + 1) for k in range(a, d + 1))
        for w, d, a in zip(stats.widths_per_round, stats.drafted_per_round, stats.accepted_per_round, strict=True)
    )


def method_result(
    prompt_id: str,
    method: str,
    out: torch.Tensor,
    prompt_tokens: int,
    seconds: float,
    stats: SpeculationStats | None,
    plain: torch.Tensor | None,
    temperature: float,
    cost_model: CostModel | None = None,
    fixed: bool = False,
    dtype: torch.dtype | None = None,
) -> MethodResult:
    """One decoded prompt as a `MethodResult` (`stats=None`: plain decoding); `fixed`: a fixed block size, whose
    greedy rounds give the per-round verify oracle's modeled time; `dtype`: the one it decoded in."""
    new_tokens = out.shape[1] - prompt_tokens
    modeled = oracle = None
    if cost_model is not None:
        plain_ms = new_tokens * cost_model.modeled_round_ms(1, 0, temperature)  # one plain step a token
        modeled = (cost_model.modeled_decode_ms(stats, temperature) if stats else plain_ms) / 1000
        oracle = round_oracle_ms(cost_model, stats) / 1000 if fixed and stats and temperature == 0 else None
    return MethodResult(
        prompt_id=prompt_id,
        method=method,
        block_size=stats.block_size if stats else 1,
        new_tokens=new_tokens,
        seconds=seconds,
        tau=stats.tau if stats else 1.0,
        identical_to_plain=None if temperature > 0 or plain is None else bool(torch.equal(out, plain)),
        policy_seconds=stats.policy_seconds if stats else 0.0,
        controller_seconds=stats.controller_seconds if stats else 0.0,
        target_forwards=stats.target_forwards if stats else new_tokens,
        draft_rounds=len(stats.committed_per_draft_round) if stats else 0,
        committed_in_draft_rounds=sum(stats.committed_per_draft_round) if stats else 0,
        verified_drafts=sum(stats.drafted_per_round) if stats else 0,
        drafted_slots=sum(w - 1 for w in stats.widths_per_round) if stats else 0,
        modeled_seconds=modeled,
        round_oracle_seconds=oracle,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
    )


def fastest_fixed_per_prompt(results: Sequence[MethodResult], clock: str = "seconds") -> list[MethodResult]:
    """Per prompt, the fixed method (plain or a fixed b) with the most tokens per second on `clock` (`seconds`,
    measured, or `modeled_seconds`): the per-prompt oracle."""
    fixed = [r for r in results if r.method == "plain" or r.method.startswith("b=")]
    return [
        max((r for r in fixed if r.prompt_id == p), key=lambda r: r.new_tokens / max(getattr(r, clock), 1e-9))
        for p in dict.fromkeys(r.prompt_id for r in fixed)
    ]


def summarize_methods(results: Sequence[MethodResult]) -> dict[str, dict[str, float]]:
    """Per method: pooled tokens/s, speedup over plain in the same dtype and over the fastest plain configuration
    (`plain` or a `plain <dtype>`), mean τ, mismatches; plus the per-prompt `oracle`.

    The oracle picks, per prompt, the fastest measured of plain decoding (b = 1, speculation off) and each
    fixed block size. `overhead`: the policy's and the per-round controller's decision time, as a share of
    generation time. Where the results carry modeled times (`decode_methods(cost_model=...)`): the same
    figures on the cost model's clock, `modeled_speedup` (the oracle then picks by modeled tokens/s) and, per fixed
    b at T = 0, `round_oracle_speedup`: the per-round verify oracle at that width (`round_oracle_ms`).
    """
    by_method: dict[str, list[MethodResult]] = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)
    oracle = fastest_fixed_per_prompt(results, "seconds")
    if oracle:
        by_method["oracle"] = [MethodResult(**{**r.__dict__, "method": "oracle"}) for r in oracle]

    def pooled(rows: list[MethodResult], clock: str = "seconds") -> float | None:
        times = [getattr(r, clock) for r in rows]
        return None if None in times else sum(r.new_tokens for r in rows) / max(sum(times), 1e-9)

    plain_tps = pooled(by_method["plain"])
    fastest_plain_tps = max(pooled(rows) for method, rows in by_method.items() if method.startswith("plain"))
    plain_modeled = pooled(by_method["plain"], "modeled_seconds")
    summary = {}
    for method, rows in by_method.items():
        tps = pooled(rows)
        summary[method] = {
            "tokens_per_second": tps,
            "speedup": tps / plain_tps,
            "speedup_vs_fastest_plain": tps / fastest_plain_tps,
            "tau": sum(r.tau for r in rows) / len(rows),
            "mismatches": sum(1 for r in rows if r.identical_to_plain is False),
            "policy_overhead": sum(r.policy_seconds for r in rows) / max(sum(r.seconds for r in rows), 1e-9),
            "controller_overhead": sum(r.controller_seconds for r in rows) / max(sum(r.seconds for r in rows), 1e-9),
            "verified_per_round": sum(r.verified_drafts for r in rows) / max(sum(r.draft_rounds for r in rows), 1),
        }
        if plain_modeled is not None:
            modeled = pooled(
                fastest_fixed_per_prompt(results, "modeled_seconds") if method == "oracle" else rows, "modeled_seconds"
            )
            summary[method]["modeled_speedup"] = modeled / plain_modeled if modeled is not None else None
            round_oracle = pooled(rows, "round_oracle_seconds") if method.startswith("b=") else None
            if round_oracle is not None:
                summary[method]["round_oracle_speedup"] = round_oracle / plain_modeled
    return summary
