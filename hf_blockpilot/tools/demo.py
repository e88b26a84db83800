"""Gradio demo: plain `generate` and BlockPilot side by side, streamed, with each verify round highlighted.

hf-blockpilot demo [--target ID] [--drafter ID] [--policy ID] [--share]
"""

from __future__ import annotations

import html
import queue
import threading
import time
from collections.abc import Iterator

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

from ..controllers import DraftController, default_controller
from ..data import chat_inputs
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..stats import SpeculationStats

MAX_QUEUED = 8  # requests waiting beyond this are turned away (the demo decodes one at a time)
ROUND_COLORS = ("#fde68a", "#bfdbfe", "#bbf7d0", "#fbcfe8")
BONUS_STYLE = "text-decoration: underline; font-weight: 600"


class RoundStreamer(BaseStreamer):
    """Receives one `put` per verify round (the tokens that round committed) and queues them; `stats` is the
    request's statistics as they fill in (`drafter.last_stats`, read in the decoding thread, the one the call's
    statistics are its latest in)."""

    def __init__(self, drafter: BlockDiffusionDrafter | None = None) -> None:
        self.rounds: queue.Queue = queue.Queue()
        self.drafter = drafter
        self.stats: SpeculationStats | None = None
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.drafter is not None:
            self.stats = self.drafter.last_stats
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.rounds.put(value.view(-1).tolist())

    def end(self) -> None:
        self.rounds.put(None)


def rounds_html(
    tokenizer: PreTrainedTokenizerBase, rounds: list[list[int]], stats: SpeculationStats | None = None
) -> str:
    """Each round's tokens in its own colour; the round's last token (the target's bonus token) underlined.

    With the request's `stats`, each round's tooltip says how many slots were drafted, how many drafts the
    controller sent to the target and how many were accepted; rounds whose verification was cut short (fewer
    drafts verified than drafted) get the class `truncated` and a dashed outline.
    """
    parts = []
    for i, tokens in enumerate(rounds):
        color = ROUND_COLORS[i % len(ROUND_COLORS)]
        drafted = html.escape(tokenizer.decode(tokens[:-1], skip_special_tokens=True))
        bonus = html.escape(tokenizer.decode(tokens[-1:], skip_special_tokens=True))
        title, classes, style = f"round {i}: {len(tokens) - 1} accepted + 1", f"round round-{i}", ""
        if stats is not None and i < min(len(stats.widths_per_round), len(stats.drafted_per_round)):
            slots, verified = stats.widths_per_round[i] - 1, stats.drafted_per_round[i]
            title = f"round {i}: {slots} drafted, {verified} verified, {len(tokens) - 1} accepted + 1"
            if verified < slots:
                classes += " truncated"
                style = "; outline: 1px dashed #555"
        parts.append(
            f'<span class="{classes}" style="background:{color}; border-radius: 3px{style}" title="{title}">'
            f'{drafted}<span class="bonus" style="{BONUS_STYLE}">{bonus}</span></span>'
        )
    style = "white-space: pre-wrap; overflow-wrap: anywhere; font-family: monospace"
    return f'<div class="blocks" style="{style}">' + "".join(parts) + "</div>"


class StopWhenSet(StoppingCriteria):
    """Ends `generate` at the next round once `event` is set (the client that asked went away)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _in_thread(fn, result: dict, **kwargs) -> threading.Thread:
    """Run `fn(**kwargs)` in a daemon thread; its return value lands in `result["output"]`."""
    thread = threading.Thread(target=lambda: result.update(output=fn(**kwargs)), daemon=True)
    thread.start()
    return thread


def compare_stream(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompt: str,
    max_new_tokens: int,
    controller: DraftController | None = None,
) -> Iterator[tuple[str, str, str, dict]]:
    """Yield (plain text, BlockPilot HTML, stats markdown, policy probabilities) as both decodes stream.

    Plain `generate` runs first, then BlockPilot (with `controller`, default the drafter's own settings), one
    after the other, so neither slows the other's timing. When the consumer stops iterating (Gradio cancels the
    job of a client that disconnected), the running `generate` stops at its next round instead of running on.
    """
    cancelled = threading.Event()
    try:
        yield from _compare_stream(target, tokenizer, drafter, prompt, max_new_tokens, controller, cancelled)
    finally:
        cancelled.set()


def _compare_stream(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    prompt: str,
    max_new_tokens: int,
    controller: DraftController | None,
    cancelled: threading.Event,
) -> Iterator[tuple[str, str, str, dict]]:
    input_ids = chat_inputs(tokenizer, prompt, target.device)
    gen = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        attention_mask=torch.ones_like(input_ids),
        stopping_criteria=StoppingCriteriaList([StopWhenSet(cancelled)]),
    )
    plain_text, blocks, stats_md, probs = "", "", "", {}
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    plain_out: dict = {}
    thread = _in_thread(target.generate, plain_out, inputs=input_ids, streamer=streamer, **gen)
    for piece in streamer:
        plain_text += piece
        yield plain_text, blocks, "plain generate running…", probs
    thread.join()
    plain_seconds = time.perf_counter() - start

    rounds_streamer = RoundStreamer(drafter)
    rounds: list[list[int]] = []
    start = time.perf_counter()
    ours_out: dict = {}
    thread = _in_thread(
        target.generate,
        ours_out,
        inputs=input_ids,
        streamer=rounds_streamer,
        assistant_model=drafter,
        draft_controller=controller,
        return_dict_in_generate=True,
        **gen,
    )
    while (tokens := rounds_streamer.rounds.get()) is not None:
        rounds.append(tokens)
        # the request's statistics fill in as it runs (the generator updates them in place)
        yield plain_text, rounds_html(tokenizer, rounds, rounds_streamer.stats), "BlockPilot running…", probs
    thread.join()
    seconds = time.perf_counter() - start
    stats = drafter.last_stats = ours_out["output"].speculation_stats  # this thread's latest call too
    plain_tps = (plain_out["output"].shape[1] - input_ids.shape[1]) / plain_seconds
    tps = stats.new_tokens / seconds
    probs = policy_scores(stats.policy_probs, getattr(drafter.policy, "weighs_costs", False))
    rounds_with_drafts = max(len(stats.committed_per_draft_round), 1)
    stats_md = (
        f"**controller** {stats.controller} · **block size** {stats.block_size} · **τ** {stats.tau:.2f} · "
        f"**rounds** {stats.target_forwards} · **drafts verified / round** "
        f"{sum(stats.drafted_per_round) / rounds_with_drafts:.1f} of "
        f"{sum(w - 1 for w in stats.widths_per_round) / rounds_with_drafts:.1f} drafted · "
        f"**tokens/s** {tps:.1f} (plain {plain_tps:.1f}) · **speedup** {tps / plain_tps:.2f}×"
        + (f" · policy {1000 * stats.policy_seconds:.1f} ms" if stats.policy_probs else "")
        + f" · per-round decisions {1000 * stats.controller_seconds:.1f} ms"
        + (f" · prompt-lookup rounds {stats.lookup_rounds}" if drafter.prompt_lookup else "")
    )
    yield plain_text, rounds_html(tokenizer, rounds, stats), stats_md, probs


def policy_scores(scores: dict[int, float] | None, predicts_tau: bool) -> dict[str, float]:
    """The policy's score per candidate for a `gr.Label` (values in [0, 1]): probabilities as they are, a τ
    policy's predicted τ(b) relative to the largest."""
    scores = scores or {}
    scale = max(scores.values(), default=1.0) if predicts_tau else 1.0
    return {f"b={b}": value / scale for b, value in scores.items()}


def build_demo(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: BlockDiffusionDrafter,
    controller: DraftController | None = None,
):
    """The Gradio Blocks app (call `.queue().launch()`); one request at a time shares the models safely.

    `controller`: how BlockPilot drafts and verifies (default: what `generate` runs by default,
    `default_controller(drafter)`)."""
    import gradio as gr

    controller = controller or default_controller(drafter)

    def run(prompt: str, max_new_tokens: int):
        yield from compare_stream(target, tokenizer, drafter, prompt, int(max_new_tokens), controller)

    with gr.Blocks(title="hf-blockpilot") as demo:
        gr.Markdown(
            "# hf-blockpilot\nBlock-diffusion speculative decoding with a per-request block size. Left: plain "
            "`generate`. Right: each coloured span is one verify round (accepted drafts + the target's underlined "
            "bonus token); a dashed outline marks a round whose verification the per-round controller cut short "
            "(hover for drafted / verified / accepted). Greedy output is identical on both sides."
        )
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt", scale=4)
            max_new = gr.Slider(8, 512, value=128, step=8, label="max new tokens", scale=1)
        run_button = gr.Button("Run", variant="primary", elem_id="run")
        with gr.Row():
            plain = gr.Textbox(label="plain generate", lines=12, elem_id="plain-output")
            with gr.Column():
                gr.Markdown("**BlockPilot** (one colour per verify round)")
                fast = gr.HTML(elem_id="blockpilot-output")
        stats = gr.Markdown(elem_id="stats")
        predicts_tau = getattr(drafter.policy, "weighs_costs", False)
        what = "predicted τ(b), relative to the largest," if predicts_tau else "probability"
        probs = gr.Label(label=f"policy: {what} per block size", elem_id="policy-probs")
        run_button.click(run, inputs=[prompt, max_new], outputs=[plain, fast, stats, probs], concurrency_limit=1)
    return demo.queue(default_concurrency_limit=1, max_size=MAX_QUEUED)
