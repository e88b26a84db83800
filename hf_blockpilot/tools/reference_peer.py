"""Speed against the DFlash authors' reference loop (`dflash_generate` of PyPI `dflash==0.1.0`), side by side.

Same process, target, drafter weights, block size and prompts: ours through `generate(assistant_model=...)`,
theirs through `dflash_generate`, each with a per-round breakdown (drafter forward / target forward / the rest
of the loop) taken by timing hooks on the two models. The reference drops a reduced draft vocabulary's `d2t`,
so both sides run the drafter's full-vocabulary variant. The package is optional (`pip install --no-deps
dflash==0.1.0`) and only imported here, when asked for.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..controllers import DraftController
from ..data import PromptRecord, chat_inputs
from ..modeling_block_diffusion import BlockDiffusionDrafter
from .evaluation import timed_call

REFERENCE_PACKAGE = "dflash==0.1.0"


def full_vocabulary_variant(drafter: BlockDiffusionDrafter) -> BlockDiffusionDrafter:
    """The drafter with the same weights scoring the target's whole vocabulary (no `d2t` shortlist): what the
    reference loads from a reduced-vocabulary checkpoint. A full-vocabulary drafter is returned as it is."""
    if drafter.d2t is None:
        return drafter
    config = drafter.config.__class__.from_dict({**drafter.config.to_dict(), "draft_vocab_size": None})
    variant = BlockDiffusionDrafter(config).to(drafter.device, drafter.dtype)
    variant.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "d2t"})
    return variant.eval()


def load_reference_drafter(drafter: BlockDiffusionDrafter) -> nn.Module:
    """The reference's `DFlashDraftModel` with `drafter`'s weights (saved in the z-lab layout and loaded back by
    the reference's own loader)."""
    if drafter.d2t is not None:
        raise ValueError(
            "the reference drops d2t and drafts over the full vocabulary: pass full_vocabulary_variant(drafter)"
        )
    try:
        from dflash.model import DFlashDraftModel
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"the speed comparison runs the DFlash authors' package: pip install --no-deps {REFERENCE_PACKAGE}"
        ) from None
    with tempfile.TemporaryDirectory() as directory:
        drafter.save_pretrained(directory)
        return DFlashDraftModel.from_pretrained(directory, dtype=drafter.dtype).to(drafter.device).eval()


class StageTimer:
    """Wall time inside each named module's forward, by pre/post hooks (synchronising CUDA at both ends, so a
    breakdown run on a GPU is a little slower than an untimed one)."""

    def __init__(self, **modules: nn.Module):
        self.modules = modules
        self.seconds = dict.fromkeys(modules, 0.0)
        self.calls = dict.fromkeys(modules, 0)

    @contextmanager
    def active(self) -> Iterator[StageTimer]:
        handles, started = [], {}
        for name, module in self.modules.items():
            cuda = next(module.parameters()).device.type == "cuda"

            def before(_module, _args, name=name, cuda=cuda):
                if cuda:
                    torch.cuda.synchronize()
                started[name] = time.perf_counter()

            def after(_module, _args, _output, name=name, cuda=cuda):
                if cuda:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - started[name]
                self.calls[name] += 1

            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


@dataclass
class PeerRun:
    """One prompt decoded by one side (`hf-blockpilot` or `dflash-reference`) at one block size."""

    prompt_id: str
    method: str
    block_size: int
    new_tokens: int
    seconds: float
    target_forwards: int  # the prefill included
    drafter_seconds: float
    target_seconds: float
    identical_to_plain: bool | None


def _stop_ids(target: PreTrainedModel) -> list[int] | None:
    eos = target.generation_config.eos_token_id
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _timed(
    run: Callable[[], torch.Tensor], target: nn.Module, drafter: nn.Module
) -> tuple[torch.Tensor, float, StageTimer]:
    timer = StageTimer(drafter=drafter, target=target)
    with timer.active():
        out, seconds = timed_call(run, target)
    return out, seconds, timer


def _ours(target, drafter, input_ids, block_size, max_new_tokens, temperature) -> torch.Tensor:
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        assistant_model=drafter,
        draft_controller=DraftController(block_size),
        max_new_tokens=max_new_tokens,
        **sampling,
    )


def _theirs(target, reference, input_ids, block_size, max_new_tokens, temperature) -> torch.Tensor:
    # load_reference_drafter has checked that the package is there
    from dflash.model import dflash_generate

    with warnings.catch_warnings():  # it passes the target `past_key_values=`, which newer Transformers deprecate
        warnings.simplefilter("ignore", FutureWarning)
        return dflash_generate(
            reference,
            target,
            input_ids,
            max_new_tokens,
            _stop_ids(target),
            temperature=temperature,
            block_size=block_size,
        )


class ReferencePeer:
    """Ours and the reference side by side on `drafter`'s full-vocabulary weights; building it loads the
    reference once (and fails at once when its package is missing)."""

    def __init__(self, drafter: BlockDiffusionDrafter):
        self.ours = full_vocabulary_variant(drafter)
        self.sides = {
            "hf-blockpilot": (_ours, self.ours),
            "dflash-reference": (_theirs, load_reference_drafter(self.ours)),
        }

    @torch.inference_mode()
    def compare(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        prompts: Sequence[PromptRecord],
        block_sizes: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        repeats: int = 1,
    ) -> list[PeerRun]:
        """Decode each prompt with ours and the reference at each block size (round-robin per repeat, median
        kept); at T=0 both outputs are compared with plain greedy `generate`. Prompt lookup is off on both sides
        (the reference has none)."""
        lookup, self.ours.prompt_lookup = self.ours.prompt_lookup, False
        try:
            return [
                run
                for record in tqdm(prompts, desc="ours vs reference", unit="prompt")
                for run in self._compare_one(
                    target, tokenizer, record, block_sizes, max_new_tokens, temperature, repeats
                )
            ]
        finally:
            self.ours.prompt_lookup = lookup

    def _compare_one(
        self, target, tokenizer, record, block_sizes, max_new_tokens, temperature, repeats
    ) -> list[PeerRun]:
        input_ids = chat_inputs(tokenizer, record.prompt, target.device, record.history)
        plain = target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
        )[0, input_ids.shape[1] :]
        runs = []
        for b in block_sizes:
            for decode, model in self.sides.values():  # one-time costs (lazy CUDA set-up) are not timed
                _timed(partial(decode, target, model, input_ids, b, 4, temperature), target, model)
            timed: dict[str, list] = {name: [] for name in self.sides}
            for _ in range(repeats):
                for name, (decode, model) in self.sides.items():
                    run = partial(decode, target, model, input_ids, b, max_new_tokens, temperature)
                    timed[name].append(_timed(run, target, model))
            for name, results in timed.items():
                out, seconds, timer = sorted(results, key=lambda r: r[1])[len(results) // 2]
                new = out[0, input_ids.shape[1] :]
                same = None if temperature > 0 else bool(torch.equal(new, plain))
                runs.append(
                    PeerRun(
                        record.id,
                        name,
                        b,
                        new.numel(),
                        seconds,
                        timer.calls["target"],
                        timer.seconds["drafter"],
                        timer.seconds["target"],
                        same,
                    )
                )
        return runs


def summarize_peers(runs: Sequence[PeerRun]) -> list[dict]:
    """Per (block size, side): pooled tokens/s, τ, per-round drafter / target / loop ms, mismatches, and
    ours / reference tokens/s."""
    rows = []
    for b in dict.fromkeys(r.block_size for r in runs):
        by_side = {}
        for side in ("hf-blockpilot", "dflash-reference"):
            mine = [r for r in runs if r.block_size == b and r.method == side]
            seconds = sum(r.seconds for r in mine)
            rounds = max(sum(r.target_forwards - 1 for r in mine), 1)  # the prefill commits the first token
            drafter, verify = sum(r.drafter_seconds for r in mine), sum(r.target_seconds for r in mine)
            by_side[side] = {
                "block_size": b,
                "method": side,
                "tokens_per_second": sum(r.new_tokens for r in mine) / max(seconds, 1e-9),
                "tau": sum(r.new_tokens - 1 for r in mine) / rounds,
                "drafter_ms_per_round": 1000 * drafter / rounds,
                "target_ms_per_round": 1000 * verify / rounds,
                "loop_ms_per_round": 1000 * (seconds - drafter - verify) / rounds,
                "mismatches": sum(r.identical_to_plain is False for r in mine),
            }
        ratio = by_side["hf-blockpilot"]["tokens_per_second"] / max(
            by_side["dflash-reference"]["tokens_per_second"], 1e-9
        )
        for row in by_side.values():
            rows.append({**row, "ours_over_reference": ratio})
    return rows


def peer_markdown(rows: Sequence[dict]) -> str:
    """The side-by-side table (`bench --reference`)."""
    lines = [
        (
            "| b | implementation | tokens/s | τ | drafter ms / round | target ms / round | loop ms / round "
            "| greedy mismatches | ours / reference |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block_size']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['tau']:.2f} | "
            f"{r['drafter_ms_per_round']:.1f} | {r['target_ms_per_round']:.1f} | {r['loop_ms_per_round']:.1f} | "
            f"{r['mismatches']} | {r['ours_over_reference']:.2f}× |"
        )
    return "\n".join(lines)
