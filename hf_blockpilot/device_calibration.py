"""Per-device calibration: what a speculative round costs on the machine `generate` runs on.

Speed decisions (how wide to draft, how many drafts to verify, whether to speculate at all) are weighed against a
`CostModel`. The first time a (device, dtype, thread count, target, drafter) pair decodes, `resolve_cost_model` times
what those decisions need (target forwards over 1..max-width tokens at a realistic context, verified as `generate`
verifies; the drafter per width; the sampling work) over `CALIBRATION_REPEATS` interleaved rounds, in seconds, and
caches the result as JSON under the package cache, keyed by a fingerprint of the device (CPU model and its matmul
flags, or GPU name and capability), torch version, threads, dtype and models.
Later runs read the cache (0 s); a damaged or mismatched entry is re-measured with one warning.

Opt out with `HF_BLOCKPILOT_CALIBRATE=0` (the shipped tables are then used, named as fallbacks in
`SpeculationStats.cost_model_source`) or pass a `CostModel` of your own (`AdaptiveVerify(cost_model=...)`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel

from ._compat import cache_argument, decode_dtypes
from .controllers import TauEvidence
from .costs import PRIOR_ACCEPTANCE, CostModel
from .exact_verify import (
    ONE_ROW_STEPS,
    remember_row_exact,
    row_exact_table,
    slot_key_lengths,
    takes_one_row_products,
    verify_view,
)
from .modeling_block_diffusion import BlockDiffusionDrafter, DraftCache, DraftContextCache, StaticDraftContextCache

logger = logging.getLogger(__name__)

#: Bump when what is measured changes: older cache entries are then re-measured.
CALIBRATION_VERSION = 20  # 2: half-precision verifies timed with one-token-exact attention; 3: batch axis;
# 4: every CPU verify timed on the exact path, and probed (`inexact_rows`); 5: a batch's verify slot by slot;
# 6: the CPU verify kernels gone (one timing per width); 7: prefills timed (`prefill_ms`); 8: bfloat16 verifies
# through `row_kernel` where it probes exact; 9: a split linear's products in one batched call
# (`exact_verify.batched_linear`), and one-row steps timed with split products (then `split_one_row`);
# 10: float32 verifies through `row_kernel` where it probes exact; 11: one-row steps timed on `row_kernel` too
# (`CostModel.one_row_steps`); 12: one-query bfloat16 attention (steps and verify slots) on `attention_kernel` where it
# probes exact; 13: bfloat16 verifies through `row_kernel` on avx512_bf16 CPUs (`bf16_pair_rows`) where it pays;
# 14: a batch's verify slots on SDPA again (13 timed them on the attention kernel, which padded batches do not take);
# 15: batches timed padded (masked slots in one C++ loop, `exact_verify.slot_calls`), bfloat16 products of a batch's
# rows on `row_kernel` where it probes exact for products of that many rows; 16: a batch's lockstep step timed on the
# stock model too (`CostModel.batch_steps`); 17: every linear probe also on `row_kernel.order_probe` inputs (an AMX
# Xeon's products agreed with the native bfloat16 kernel, and its 64 x 64 products of k rows with one row's, on
# random inputs only); 18: float32 verifies through `row_kernel.f32_rows16` (MKL's AVX-512 one-row order) where it
# probes exact and pays; 19: one-query float32 attention (steps and verify slots) on `attention_kernel` where it
# probes exact; 20: a single request's forwards timed over `CALIBRATION_REPEATS` rounds (5 before)
#: Widths timed by default (target forwards over n tokens; drafter blocks of n slots).
DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
#: A single request's one-token steps take split or kernel one-row products (`CostModel.one_row_steps`), and a batch's
#: lockstep steps the exact view (`CostModel.batch_steps`), only where the calibration timed them below this fraction
#: of the stock step: a tie is not worth a different path.
ONE_ROW_STEP_GAIN = 0.97
#: CPU flags that change which matmul kernels run (and so every timing): part of the fingerprint.
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
CALIBRATE_ENV = "HF_BLOCKPILOT_CALIBRATE"
#: Timed rounds of a single request's calibration. On a 2-core KVM Zen 5 EPYC one forward's time moves +-30 % call to
#: call; a table of 5 rounds put the ratios decisions rest on (verify / step) 0.09-0.14 off (sd), which cost the
#: default 0.8-1.2 % modeled on HumanEval and GSM8K (worst draw 5 %), 20 rounds 0.2-0.5 % (worst 2.4 %):
#: scripts/calibration_noise_bench.py, docs/benchmarks.md "How noisy one calibration is".
CALIBRATION_REPEATS = 20


def cache_root() -> Path:
    """The package cache: `$HF_BLOCKPILOT_CACHE`, else `$XDG_CACHE_HOME/hf_blockpilot`, else
    `~/.cache/hf_blockpilot`."""
    explicit = os.environ.get("HF_BLOCKPILOT_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hf_blockpilot"


def calibration_enabled() -> bool:
    """False when `HF_BLOCKPILOT_CALIBRATE` is `0`, `false`, `no` or `off`."""
    return os.environ.get(CALIBRATE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_description(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """The CPU's model name with its family and model numbers, and which of `MATMUL_FLAGS` it has, from `cpuinfo`
    (the text of /proc/cpuinfo; read where there is one). Virtual machines often name only the brand ("AMD EPYC")
    for CPUs whose kernels differ: the family and model numbers tell them apart."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields, flags = {}, set()
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("flags", "Features"):
            flags = set(value.split())
            break
        fields.setdefault(key, value)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name = f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name, [f for f in MATMUL_FLAGS if f in flags]


def describe_device(device: torch.device | str) -> dict[str, Any]:
    """What identifies a device's speed: CPU model and matmul flags, or GPU name and compute capability."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"device": "cuda", "name": torch.cuda.get_device_name(index), "flags": [f"sm_{major}{minor}"]}
    if device.type == "cpu":
        name, flags = cpu_description()
        return {"device": "cpu", "name": name, "flags": flags}
    return {"device": device.type, "name": device.type, "flags": []}


def model_identity(model: nn.Module) -> dict[str, str]:
    """A model's name, revision and a hash of its config (tells apart models built in memory), without the dtype
    the config records (the fingerprint has the weights' own: a model loaded in bfloat16 and a float32 one cast to
    it share a calibration)."""
    config = model.config
    fields = {
        k: v for k, v in json.loads(config.to_json_string(use_diff=False)).items() if k not in ("dtype", "torch_dtype")
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return {
        "name": str(getattr(config, "_name_or_path", "") or ""),
        "revision": str(getattr(config, "_commit_hash", "") or ""),
        "config": digest,
    }


def device_fingerprint(target: PreTrainedModel, drafter: nn.Module) -> dict[str, Any]:
    """Everything a calibration depends on; a cached calibration serves only an equal fingerprint."""
    parameter = next(target.parameters())
    return {
        "version": CALIBRATION_VERSION,
        **describe_device(parameter.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "target": model_identity(target),
        "drafter": model_identity(drafter),
    }


def fingerprint_key(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]


def sampling_processors(
    target: PreTrainedModel, input_ids: torch.LongTensor, temperature: float
) -> LogitsProcessorList:
    """The logits processors `target.generate(input_ids, do_sample=True, temperature=...)` samples with: the
    target's generation defaults merged as `generate` merges them (top-k, top-p, ...).

    Uses `generate`'s own (private) preparation steps, so the distributions are the ones decoding uses.
    """
    config, _ = target._prepare_generation_config(None, do_sample=True, temperature=temperature)
    return target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(),
    )


def interleaved_median_ms(
    fns: dict[Any, Callable[[], None]], repeats: int, device: torch.device, progress: tqdm | None = None
) -> dict[Any, float]:
    """Median wall time (ms) of each function over `repeats` rounds (`interleaved_times_ms`)."""
    return {key: statistics.median(t) for key, t in interleaved_times_ms(fns, repeats, device, progress).items()}


def interleaved_times_ms(
    fns: dict[Any, Callable[[], None]], repeats: int, device: torch.device, progress: tqdm | None = None
) -> dict[Any, list[float]]:
    """Wall times (ms) of each function over `repeats` rounds, each round calling every function once.

    Interleaving makes slow periods of a noisy host hit every variant alike instead of biasing whichever was
    timed then; a first round, not returned, is warm-up. `progress` advances by one per call.
    """
    times: dict[Any, list[float]] = {key: [] for key in fns}
    for _ in range(repeats + 1):
        for key, fn in fns.items():
            _, seconds = timed(fn, device)
            times[key].append(1000 * seconds)
            if progress is not None:
                progress.update()
    return {key: t[1:] for key, t in times.items()}


def timed(run: Callable[[], Any], device: torch.device | str) -> tuple[Any, float]:
    """`run()` and its wall time in seconds, the device synchronised before and after (CUDA)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


@dataclass
class Calibration:
    """One device's measured costs for one target + drafter pair.

    `cost_model.target_ms`: a target forward over n tokens as `generate` verifies (on CPU: the exact path).
    `row_exact`: this machine's `row_exact_rows` of the target's linear layers (`exact_verify.row_exact_table`), so
    later processes skip that probe.
    """

    fingerprint: dict[str, Any]
    cost_model: CostModel
    row_exact: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # how long measuring took
    from_cache: bool = field(default=False, compare=False)  # read from the cache rather than measured now

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "cost_model": self.cost_model.to_dict(),
            "row_exact": self.row_exact,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Calibration:
        return cls(
            fingerprint=raw["fingerprint"],
            cost_model=CostModel.from_dict(raw["cost_model"]),
            row_exact={key: int(rows) for key, rows in raw.get("row_exact", {}).items()},
            seconds=float(raw.get("seconds", 0.0)),
        )

    def table(self) -> str:
        """The measured costs as a text table (plain steps = a one-token target forward)."""
        cost, plain = self.cost_model, self.cost_model.verify_ms(1)
        lines = [f"{'n':>4} {'target ms':>10} {'plain steps':>12} {'drafter ms':>11}"]
        for n, ms in sorted(cost.target_ms.items()):
            drafter = f"{cost.draft_ms(n):11.2f}" if n > 1 else f"{'-':>11}"
            lines.append(f"{n:>4} {ms:10.2f} {cost.verify_ms(n) / plain:12.2f} {drafter}")
        lines.append(
            f"sampling: {cost.sampling_process_ms:.2f} ms to process a row of logits, "
            f"{cost.sampling_draw_ms:.2f} ms per draw"
        )
        if cost.device == "cpu":  # where the other ways are timed
            lines.append(f"one-token steps: {cost.one_row_steps} one-row products, the fastest of {ONE_ROW_STEPS}")
        for batch, way in sorted(cost.batch_steps.items()):
            lines.append(f"batch {batch}: lockstep steps on the {way} model ({cost.batch_target_ms[batch][1]:.2f} ms)")
        return "\n".join(lines)


#: Per target (and per drafter): the compiled verify (block) costs measured for it (`compiled_cost_model`), by shapes.
_compiled_ms: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()


@torch.no_grad()  # as the loop runs (inference mode would compile graphs of its own)
def compiled_cost_model(
    target: PreTrainedModel,
    compiled: Callable[..., Any],
    cost: CostModel,
    max_width: int,
    capacity: int,
    drafter: BlockDiffusionDrafter | None = None,
    compiled_drafter: Callable[..., Any] | None = None,
    repeats: int = 3,
    context_tokens: int = 64,
) -> CostModel:
    """`cost` with its target forwards as `generate(..., compile=...)` runs them: `compiled` (the target's compiled
    call) over the loop's static cache of `capacity` slots, for each width up to `max_width`: probed against plain
    decoding's eager one-token steps (`inexact_rows`: those whose logits or cached keys/values differ bit for bit)
    and timed; and, given the `drafter` and its `compiled_drafter` forward, its block forwards over a static context
    cache as large, timed as the calibration times them. Compiles the graphs the call then runs; measured once per
    model and shapes."""
    from .batched import RaggedCache

    sizes = [n for n in sorted(cost.target_ms) if n <= max_width]
    key = (capacity, tuple(sizes), str(next(target.parameters()).dtype))
    measured = _compiled_ms.setdefault(target, {})
    if key not in measured:
        ids, cache, steps, plain_cache = _plain_steps(target, context_tokens, max(sizes))
        prompt = torch.ones(1, context_tokens, dtype=torch.bool, device=ids.device)
        plan = RaggedCache.convert(cache, prompt, padded=False, single=True, capacity=capacity)

        def verify(n: int) -> Callable[[], Any]:
            return lambda: compiled(
                input_ids=ids[:, context_tokens : context_tokens + n].clone(memory_format=torch.contiguous_format),
                attention_mask=plan.prepare(n),
                position_ids=torch.arange(context_tokens, context_tokens + n, device=ids.device)[None],
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=n,
                **{cache_argument(target): cache},
            )

        inexact = [n for n in sizes if not _same_as_steps(verify(n)().logits, cache, steps, plain_cache, n)]
        ms = interleaved_median_ms({n: verify(n) for n in sizes}, repeats, ids.device)
        measured[key] = (ms, inexact)
    ms, inexact = measured[key]
    drafter_ms, timed = cost.drafter_ms, "target forwards"
    draft_sizes = tuple(n for n in sorted(cost.drafter_ms) if n <= max_width)
    if compiled_drafter is not None and draft_sizes:
        drafts, draft_key = _compiled_ms.setdefault(drafter, {}), (capacity, draft_sizes, str(drafter.dtype))
        if draft_key not in drafts:
            drafts[draft_key] = _compiled_draft_ms(target, drafter, compiled_drafter, draft_sizes, capacity, repeats)
        drafter_ms, timed = {**cost.drafter_ms, **drafts[draft_key]}, "target and drafter forwards"
    return dataclasses.replace(
        cost, target_ms=ms, drafter_ms=drafter_ms, inexact_rows=inexact, source=f"{cost.source}; {timed} timed compiled"
    )


def _compiled_draft_ms(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    compiled_drafter: Callable[..., Any],
    sizes: tuple[int, ...],
    capacity: int,
    repeats: int,
    context_tokens: int = 64,
) -> dict[int, float]:
    """Milliseconds of `compiled_drafter`'s block forward (`_draft_run`) per width in `sizes`, after a
    `context_tokens`-token context in a static cache of `capacity` slots."""
    ids = torch.randint(0, target.get_input_embeddings().weight.shape[0], (1, context_tokens + max(sizes)))
    ids = ids.to(target.device)
    states = target(ids[:, :context_tokens], output_hidden_states=True).hidden_states
    hidden = torch.cat([states[i + 1] for i in drafter.target_layer_ids], dim=-1).to(drafter.dtype)
    fns = {
        n: _draft_run(target, drafter, hidden, ids[:, context_tokens : context_tokens + n], capacity, compiled_drafter)
        for n in sizes
    }
    return interleaved_median_ms(fns, repeats, target.device)


def _draft_run(
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    hidden: torch.Tensor,
    block: torch.LongTensor,
    capacity: int | None = None,
    compiled: Callable[..., Any] | None = None,
) -> Callable[[], None]:
    """One drafting step as the loop runs it, to time: the drafter's forward over `block` (rows, n) after the
    context of target states `hidden` (rows, c, ·) taken in, then the draft head's argmax; eager over a growing
    cache, or the `compiled` forward over a static one of `capacity` slots."""
    rows, context_tokens = hidden.shape[:2]
    context_positions = torch.arange(context_tokens, device=hidden.device)[None].expand(rows, -1)
    positions = context_tokens + torch.arange(block.shape[1], device=hidden.device)[None].expand(rows, -1)
    cache: DraftCache = DraftContextCache()
    if compiled is not None:
        cache = StaticDraftContextCache(rows, capacity, hidden.device)
        cache.place(context_positions, torch.ones_like(context_positions, dtype=torch.bool))
    drafter.extend_context(hidden, context_positions, cache)
    embed = target.get_input_embeddings()
    head_weight, head_bias = drafter.draft_head(target.get_output_embeddings())

    def run() -> None:
        h = (compiled or drafter)(
            block_embeds=drafter.embed_block(embed, block).to(drafter.dtype),
            block_position_ids=positions,
            target_hidden=hidden.new_zeros(rows, 0, hidden.shape[-1]),
            context_position_ids=positions.new_zeros(rows, 0),
            cache=cache,
        ).last_hidden_state
        # contiguous, as generate hands it over (a strided bfloat16 input sends F.linear down a slow path)
        drafter.head_logits(h[:, 1:].contiguous(), head_weight, head_bias).argmax(-1)

    return run


def _plain_steps(
    target: PreTrainedModel, context_tokens: int, tokens: int
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Plain decoding's reference: random ids, a cache of their first `context_tokens` (the next `tokens` steps
    cropped off again), the logits of those eager one-token steps and each layer's keys/values after them."""
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, context_tokens + tokens), generator=generator).to(target.device)
    cache = DynamicCache()
    argument = cache_argument(target)
    target(ids[:, :context_tokens], **{argument: cache})
    steps = torch.cat(
        [target(ids[:, i : i + 1], **{argument: cache}).logits for i in range(context_tokens, ids.shape[1])], 1
    )
    plain_cache = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    cache.crop(-tokens)
    return ids, cache, steps, plain_cache


def _same_as_steps(
    logits: torch.Tensor, cache: Any, steps: torch.Tensor, plain_cache: list[tuple[torch.Tensor, torch.Tensor]], n: int
) -> bool:
    """Whether a forward over the next `n` tokens gave plain decoding's logits and keys/values bit for bit."""
    end = plain_cache[0][0].shape[-2] - steps.shape[1] + n
    return torch.equal(logits[:, :n], steps[:, :n]) and all(
        torch.equal(layer.keys[..., :end, :], keys[..., :end, :])
        and torch.equal(layer.values[..., :end, :], values[..., :end, :])
        for layer, (keys, values) in zip(cache.layers, plain_cache)
    )


@torch.inference_mode()
def probe_exact_verify(target: PreTrainedModel, widths: Iterable[int], context_tokens: int = 64) -> list[int]:
    """The token counts among `widths` whose verify forward, run as `generate` runs it (`verify_view`),
    does NOT give every row the logits and cached keys/values that plain decoding's one-token
    steps give, bit for bit, after the same random `context_tokens`-token prefill. Empty: greedy speculative
    decoding is token-identical to plain `generate` here, in this dtype."""
    widths = sorted(n for n in set(widths) if n > 1)
    if not widths:
        return []
    ids, cache, steps, plain_cache = _plain_steps(target, context_tokens, max(widths))
    argument = cache_argument(target)
    inexact = []
    model = verify_view(target)
    for n in widths:
        with slot_key_lengths([context_tokens], [n], masked=False):
            logits = model(ids[:, context_tokens : context_tokens + n], **{argument: cache}).logits
        if not _same_as_steps(logits, cache, steps, plain_cache, n):
            inexact.append(n)
        cache.crop(-n)
    return inexact


@torch.inference_mode()
def calibrate(
    target: PreTrainedModel,
    drafter: nn.Module,
    widths: Iterable[int] = DEFAULT_WIDTHS,
    context_tokens: int = 256,
    repeats: int = CALIBRATION_REPEATS,
) -> Calibration:
    """Probe that verifies are exact here (`probe_exact_verify`), then time target forwards over each width's
    token count as `generate` verifies (on CPU the exact path), the drafter per width, and the sampling work,
    over a `context_tokens`-long cached context."""
    begin = time.perf_counter()
    widths = sorted(set(widths) | {1})
    device = next(target.parameters()).device
    inexact = probe_exact_verify(target, widths)
    ms = _forward_ms(target, drafter, widths, context_tokens, repeats)
    steps = {"stock": ONE_ROW_STEP_GAIN * ms[("target", 1)]} | {  # another way must beat the stock step by that
        how: ms[f"{how} step"] for how in ONE_ROW_STEPS if f"{how} step" in ms
    }
    one_row = min(steps, key=steps.__getitem__)
    fingerprint = device_fingerprint(target, drafter)
    cost = CostModel(
        target_ms={n: ms[f"{one_row} step" if one_row != "stock" and n == 1 else ("target", n)] for n in widths},
        drafter_ms={n: ms[("drafter", n)] for n in widths if n > 1},
        device=str(device),
        context_tokens=context_tokens,
        sampling_process_ms=ms["sampling_process"],
        sampling_draw_ms=ms["sampling_draw"],
        inexact_rows=inexact,
        one_row_steps=one_row,
        prefill_ms={1: ms["prefill"]},
        source=f"calibrated on {fingerprint['name']}, {fingerprint['dtype']}, {fingerprint['threads']} threads",
    )
    row_exact = row_exact_table(target) if device.type == "cpu" else {}
    return Calibration(fingerprint, cost, row_exact, time.perf_counter() - begin)


@torch.inference_mode()
def calibrate_batch(
    target: PreTrainedModel,
    drafter: nn.Module,
    batch_size: int,
    widths: Iterable[int] = DEFAULT_WIDTHS,
    context_tokens: int = 256,
    repeats: int = 3,
) -> tuple[dict[int, float], dict[int, float], float, str]:
    """The batch axis of the cost model at `batch_size` rows: (target ms per n tokens a row, drafter ms per
    block of b slots a row, the prefill of the rows' contexts, what runs the lockstep steps), each row after its own
    `context_tokens`-long cached context, verified as a batched `generate` verifies (on CPU the exact path). The
    steps run on the exact view only where it beats the stock model's step by `ONE_ROW_STEP_GAIN` (then n = 1 is
    the view's step, else the stock one)."""
    widths = sorted(set(widths) | {1})
    ms = _forward_ms(target, drafter, widths, context_tokens, repeats, batch_size)
    way = "view" if ms[("target", 1)] < ONE_ROW_STEP_GAIN * ms["stock step"] else "stock"
    return (
        {n: ms["stock step" if way == "stock" and n == 1 else ("target", n)] for n in widths},
        {n: ms[("drafter", n)] for n in widths if n > 1},
        ms["prefill"],
        way,
    )


def _forward_ms(
    target: PreTrainedModel,
    drafter: nn.Module,
    widths: list[int],
    context_tokens: int,
    repeats: int,
    batch_size: int = 1,
) -> dict[Any, float]:
    """Median ms (`interleaved_median_ms`, with a progress bar) of what a calibration times, over `batch_size` rows
    after a cached context: target forwards over n tokens a row as `generate` verifies (`verify_view`), the
    drafter per width, and for one row the sampling work (one row processed, one draw); on CPU for one row
    the one-token step with split and with kernel one-row products too (`"split step"`, `"kernel step"`, each
    where some linear takes it: `takes_one_row_products`); for a batch the step on the stock model (`"stock step"`);
    and,
    timed once, the prefill of that context (`"prefill"`)."""
    device = target.device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (batch_size, context_tokens), generator=generator).to(device)
    prefix = DynamicCache()
    with_prefix = {cache_argument(target): prefix}
    # timed once (it is the longest forward): the prefill as plain `generate` runs it, the last position's logits only
    out, prefill_seconds = timed(
        lambda: target(context, **with_prefix, output_hidden_states=True, logits_to_keep=1), device
    )
    hidden = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1).to(drafter.dtype)

    def verify(n: int, model: nn.Module) -> Callable[[], None]:
        block = torch.randint(0, vocab, (batch_size, n), generator=generator).to(device)
        return _cached_forward(target, model, prefix, block, context_tokens)

    processors = sampling_processors(target, context[:1], temperature=1.0)
    row = torch.randn(1, vocab, generator=generator).to(device)
    probs = processors(context[:1], row.clone()).softmax(dim=-1)

    def process_row() -> None:
        processors(context[:1], row.clone()).softmax(dim=-1)

    def draw() -> None:
        torch.multinomial(probs, num_samples=1)

    blocks = {n: torch.randint(0, vocab, (batch_size, n), generator=generator).to(device) for n in widths if n > 1}
    fns: dict[Any, Callable[[], None]] = {
        ("drafter", n): _draft_run(target, drafter, hidden, b) for n, b in blocks.items()
    }
    if batch_size == 1:
        fns.update(sampling_process=process_row, sampling_draw=draw)
    model = verify_view(target, batch_size)  # made once, outside the timings
    fns = {("target", n): verify(n, model) for n in widths} | fns
    if batch_size > 1:  # the lockstep step on the stock model, plain batched decoding's own forward
        fns["stock step"] = verify(1, target)
    if batch_size == 1 and device.type == "cpu":  # the one-token step with split / kernel one-row products
        ways = [how for how in ONE_ROW_STEPS if how != "stock" and takes_one_row_products(target, how)]
        fns |= {f"{how} step": verify(1, verify_view(target, 1, how)) for how in ways}
    batch = f"batch {batch_size} " if batch_size > 1 else ""
    with tqdm(
        total=(repeats + 1) * len(fns),
        desc=f"hf-blockpilot: calibrating {batch}on {describe_device(device)['name']}",
        unit="forward",
        leave=False,
        mininterval=1.0,
    ) as bar:
        return interleaved_median_ms(fns, repeats, device, bar) | {"prefill": 1000 * prefill_seconds}


def _cached_forward(
    target: PreTrainedModel, model: nn.Module, prefix: DynamicCache, tokens: torch.Tensor, context_tokens: int
) -> Callable[[], None]:
    """A forward of `model` (`target` or its `verify_view`) over `tokens` (B, n) after `prefix` (every row
    `context_tokens` long), as `generate` verifies; the cache cropped back after it. A batch is timed padded (its
    first key masked in row 0), as batches of real prompts are: their verify slots take the masked path."""
    batch_size, n = tokens.shape
    padded = batch_size > 1
    mask = torch.ones(batch_size, context_tokens + n, dtype=torch.long, device=tokens.device) if padded else None
    if mask is not None:
        mask[0, 0] = 0

    def run() -> None:
        with slot_key_lengths([context_tokens] * batch_size, [n] * batch_size, masked=padded):  # as generate's
            model(tokens, attention_mask=mask, **{cache_argument(target): prefix}, output_hidden_states=True)
        prefix.crop(-n)  # negative = tokens to remove, on every Transformers 5.x

    return run


_resolved: dict[str, CostModel] = {}  # fingerprint key -> this process's cost model for it
_measuring: dict[str, threading.Event] = {}  # fingerprint key -> set when the thread measuring it is done
_resolving = threading.Lock()  # guards the two dicts only: never held across a forward


def calibration_path(fingerprint: dict[str, Any]) -> Path:
    """Where the calibration for `fingerprint` is cached."""
    return cache_root() / "calibration" / f"{fingerprint_key(fingerprint)}.json"


def resolve_cost_model(
    target: PreTrainedModel,
    drafter: nn.Module,
    given: CostModel | None = None,
    max_width: int = max(DEFAULT_WIDTHS),
    batch_size: int = 1,
    calibrate: bool | None = None,
) -> CostModel:
    """The cost model every speed decision of a request uses (the one resolution path):

    `given` if one was passed; with calibration off (`calibrate=False`, or by default `HF_BLOCKPILOT_CALIBRATE=0`)
    the shipped table for the device (a fallback); else this machine's calibration for the pair, from this
    process, the cache, or measured now (a few seconds, once, with a progress line) and cached. `max_width`: the
    widest block the caller may draft (a cached calibration narrower than it is re-measured wider). `batch_size`
    > 1: the calibration also holds the batch axis at that size (timed once and cached, see
    `CostModel.for_batch`)."""
    if given is not None:
        return given
    device = next(target.parameters()).device
    if not (calibration_enabled() if calibrate is None else calibrate):
        return CostModel.default_for(device)
    key = fingerprint_key(device_fingerprint(target, drafter))
    while True:  # one thread measures a pair; others asking for it wait for that, nobody else does
        with _resolving:
            cost = _resolved.get(key)
            wide_enough = cost is not None and max(cost.target_ms) >= max_width
            if wide_enough and (batch_size <= 1 or batch_size in cost.batch_target_ms):
                return cost
            done = _measuring.get(key)
            if done is None:
                done = _measuring[key] = threading.Event()
                break
        done.wait()
    try:
        if not wide_enough:
            cost = load_or_calibrate(target, drafter, max_width).cost_model
        if batch_size > 1 and batch_size not in cost.batch_target_ms:
            cost = add_batch_axis(target, drafter, batch_size, max_width).cost_model
        with _resolving:
            _resolved[key] = cost
        return cost
    finally:
        with _resolving:
            _measuring.pop(key).set()


def add_batch_axis(
    target: PreTrainedModel, drafter: nn.Module, batch_size: int, max_width: int = max(DEFAULT_WIDTHS)
) -> Calibration:
    """This machine's calibration for the pair with the batch axis timed at `batch_size` (`calibrate_batch`,
    once; cached with the rest)."""
    calibration = load_or_calibrate(target, drafter, max_width)
    cost = calibration.cost_model
    if batch_size not in cost.batch_target_ms:
        begin = time.perf_counter()
        widths = [n for n in sorted(cost.target_ms) if n <= max(max_width, 2)]
        (
            cost.batch_target_ms[batch_size],
            cost.batch_drafter_ms[batch_size],
            cost.prefill_ms[batch_size],
            cost.batch_steps[batch_size],
        ) = calibrate_batch(target, drafter, batch_size, widths, cost.context_tokens)
        logger.info("hf-blockpilot: timed batch %d in %.1f s", batch_size, time.perf_counter() - begin)
        save_calibration(calibration, calibration_path(calibration.fingerprint))
    return calibration


def load_or_calibrate(
    target: PreTrainedModel, drafter: nn.Module, max_width: int = max(DEFAULT_WIDTHS), force: bool = False
) -> Calibration:
    """This machine's calibration for the pair: the cached one, else (or with `force`) measured now and cached.
    A cached entry that is damaged, of another fingerprint or narrower than `max_width` is re-measured with
    one warning."""
    fingerprint = device_fingerprint(target, drafter)
    path = calibration_path(fingerprint)
    widths = sorted(set(DEFAULT_WIDTHS) | {max_width})
    if path.is_file() and not force:
        problem = None
        try:
            calibration = Calibration.from_dict(json.loads(path.read_text()))
            if calibration.fingerprint != fingerprint:
                problem = "was measured for another device, dtype or model"
            elif max(calibration.cost_model.target_ms) < max_width:
                problem = f"does not reach width {max_width}"
                widths = sorted(set(widths) | set(calibration.cost_model.target_ms))
            else:
                calibration.from_cache = True
                remember_row_exact(calibration.row_exact)
                return calibration
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSONDecodeError is a ValueError
            problem = f"is damaged ({type(err).__name__}: {err})"
        warnings.warn(f"hf-blockpilot: the calibration cached at {path} {problem}; re-measuring it", stacklevel=4)
    logger.info(
        "hf-blockpilot: calibrating %s on %s (%s), once; cached at %s",
        fingerprint["dtype"],
        fingerprint["name"],
        "exact verify path probed and timed" if fingerprint["device"] == "cpu" else fingerprint["device"],
        path,
    )
    calibration = calibrate(target, drafter, widths)
    logger.info("hf-blockpilot: calibrated in %.1f s", calibration.seconds)
    save_calibration(calibration, path)
    return calibration


#: Calibrations kept in the cache; older entries (e.g. of temporary model directories) are removed.
CACHE_ENTRIES = 64


def write_json_atomically(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file renamed over it, so readers never see half a
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(data, indent=2))
    partial.replace(path)


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write atomically (`write_json_atomically`); then keep only the `CACHE_ENTRIES` most recently written
    entries of that folder."""
    write_json_atomically(path, calibration.to_dict())
    entries = sorted(path.parent.glob("*.json"), key=lambda entry: entry.stat().st_mtime_ns, reverse=True)
    for stale in entries[CACHE_ENTRIES:]:
        stale.unlink(missing_ok=True)  # another process may have removed it first


def forget_resolved() -> None:
    """Drop this process's resolved cost models (the next request reads the cache or re-measures)."""
    with _resolving:
        _resolved.clear()


@torch.inference_mode()
def steps_side_by_side(
    targets: Mapping[Any, PreTrainedModel],
    batch_size: int = 1,
    context_tokens: int = 256,
    repeats: int = 5,
    ways: Mapping[Any, str] | None = None,
) -> dict[Any, float]:
    """Each target's one-token step (ms) over `batch_size` rows after a `context_tokens`-long cached context, as
    the calibration timed the step its table holds (`ways[key]`: for one row its `one_row_steps`, for a batch its
    `batch_steps`; "stock" where not given), all of them timed interleaved (`interleaved_median_ms`): their speeds
    at one moment of the host."""
    generator = torch.Generator().manual_seed(0)
    device = next(iter(targets.values())).device
    batch = f"batch {batch_size} " if batch_size > 1 else ""
    fns = {}
    with tqdm(
        total=len(targets) * (repeats + 2),  # each context's prefill, then its steps
        desc=f"hf-blockpilot: timing the {'/'.join(map(str, targets))} steps {batch}side by side on "
        f"{describe_device(device)['name']}",
        unit="forward",
        leave=False,
        mininterval=1.0,
    ) as bar:
        for key, target in targets.items():
            vocab = target.get_input_embeddings().weight.shape[0]
            context = torch.randint(0, vocab, (batch_size, context_tokens), generator=generator).to(device)
            prefix = DynamicCache()
            target(context, **{cache_argument(target): prefix}, logits_to_keep=1)
            bar.update()
            token = torch.randint(0, vocab, (batch_size, 1), generator=generator).to(device)
            way = (ways or {}).get(key, "stock")
            if batch_size == 1:
                model = verify_view(target, 1, way)
            else:
                model = verify_view(target, batch_size) if way == "view" else target
            fns[key] = _cached_forward(target, model, prefix, token, context_tokens)
        return interleaved_median_ms(fns, repeats, device, bar)


def host_factors(
    pairs: Mapping[torch.dtype, tuple[PreTrainedModel, nn.Module]],
    costs: Mapping[torch.dtype, CostModel],
    batch_size: int,
) -> dict[torch.dtype, float]:
    """Per dtype, the factor that brings its calibration to one host speed: each dtype was calibrated once, at
    its own time, and a shared host's speed drifts (on a KVM Zen 1, one calibration timed every width 25 % slower
    than one 20 min later). It is the one-token step timed now, every dtype side by side (`steps_side_by_side`, at
    the calibrations' context), over the step in its table; cached with the calibrations until a table changes."""
    tabled = {_dtype_name(dtype): cost.for_batch(batch_size).verify_ms(1) for dtype, cost in costs.items()}
    ways = {_dtype_name(dtype): cost.step_way(batch_size) for dtype, cost in costs.items()}  # as each was tabled
    keys = sorted(fingerprint_key(device_fingerprint(*pair)) for pair in pairs.values())
    path = (
        cache_root() / "calibration" / "side-by-side" / f"{fingerprint_key({'pairs': keys, 'batch': batch_size})}.json"
    )
    try:
        cached = json.loads(path.read_text())
        steps = cached["steps"] if cached["tabled"] == tabled else None
    except (OSError, ValueError, KeyError, TypeError):
        steps = None
    if steps is None:
        context_tokens = max(cost.context_tokens for cost in costs.values()) or 256
        logger.info("hf-blockpilot: timing the %s one-token steps side by side, once", "/".join(tabled))
        timed = steps_side_by_side({_dtype_name(d): pairs[d][0] for d in costs}, batch_size, context_tokens, ways=ways)
        steps = {dtype: timed[dtype] for dtype in tabled}
        write_json_atomically(path, {"tabled": tabled, "steps": steps})
    return {dtype: steps[_dtype_name(dtype)] / tabled[_dtype_name(dtype)] for dtype in costs}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def request_acceptance(
    target: PreTrainedModel, drafter: nn.Module, input_ids: torch.Tensor, temperature: float = 0.0
) -> float:
    """The per-slot acceptance `--dtype auto` prices a request's drafting at (`preferred_dtype`): the geometric fit
    (`TauEvidence`) of τ(b) as the drafter's τ policy predicts it from a prefill of `input_ids` (in the pair's
    dtype) at `temperature`; `PRIOR_ACCEPTANCE` where the drafter has no policy that predicts τ. (On an AMX Xeon
    bfloat16 verifies are cheap but its plain steps slower than float32's: priced at 0.5 a slot, sampled requests,
    accepted at ~0.35, went to bfloat16 and ran at 0.66-1.04x plain float32.)"""
    policy = getattr(drafter, "policy", None)
    if policy is None or not getattr(policy, "weighs_costs", False):
        return PRIOR_ACCEPTANCE
    policy.check_compatible(target, drafter)
    outputs = target(input_ids, output_hidden_states=True, logits_to_keep=1)
    _, curve = policy.choose_block_size(outputs, target.get_output_embeddings(), temperature)
    return TauEvidence(curve).acceptance


def preferred_dtype(
    target: PreTrainedModel,
    drafter: nn.Module,
    batch_size: int = 1,
    prompt_tokens: int = 64,
    new_tokens: int = 256,
    copies: Mapping[torch.dtype, tuple[PreTrainedModel, nn.Module]] | None = None,
    temperature: float = 0.0,
    acceptance: float = PRIOR_ACCEPTANCE,
) -> torch.dtype:
    """The dtype `--dtype auto` decodes a request in: `batch_size` rows of `prompt_tokens` (padded) prompt tokens
    and `new_tokens` new tokens each, sampled at `temperature`, its drafts accepted at `acceptance` a slot
    (`request_acceptance`). Among `decode_dtypes` (float32 and bfloat16 on every CPU, timed rather than
    assumed), the one whose calibration of the pair in that dtype (`copies[dtype]`, else the pair itself if in it,
    else a copy) expects the whole request fastest (`CostModel.request_ms`: the prefill, then its best width, plain
    steps included) among those whose verifies were probed exact, every table brought to one host speed
    (`host_factors`). Where none was (CUDA: cuBLAS rounds k rows unlike one), float32, whose near-ties flip least.
    float32 with calibration off. (On an AVX2-only Zen 3, bfloat16 decodes a row 1.7x faster than float32 but
    prefills 4-6x slower, emulated bfloat16 products paying for every token: long prompts, short answers and large
    batches go to float32.)"""
    dtypes = decode_dtypes(next(target.parameters()).device)
    if len(dtypes) == 1 or not calibration_enabled():
        return torch.float32
    given = dict(copies or {}) | {next(target.parameters()).dtype: (target, drafter)}
    pairs = {
        dtype: given.get(dtype) or (copy.deepcopy(target).to(dtype), copy.deepcopy(drafter).to(dtype))
        for dtype in dtypes
    }
    costs = {dtype: resolve_cost_model(*pair, batch_size=batch_size) for dtype, pair in pairs.items()}
    exact = [dtype for dtype, cost in costs.items() if not cost.inexact_rows]
    if len(exact) < 2:
        return (exact or [torch.float32])[0]
    host = host_factors(pairs, costs, batch_size)
    return min(
        exact,
        key=lambda dtype: (
            host[dtype] * costs[dtype].request_ms(prompt_tokens, new_tokens, batch_size, acceptance, temperature)
        ),
    )
