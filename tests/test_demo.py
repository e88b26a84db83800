"""Gradio demo: the streaming logic on tiny models, and a real headless-Chromium test of the app."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time

import pytest
from conftest import ScriptedDrafter, char_tokenizer, make_drafter, make_target

from hf_blockpilot.tools.demo import compare_stream, policy_scores, rounds_html

VOCAB = 48


def _pair():
    target = make_target("llama", vocab_size=VOCAB, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    tokenizer = char_tokenizer(VOCAB)
    return target, tokenizer


def test_compare_stream_shows_every_round_and_matching_text():
    target, tokenizer = _pair()
    ids = tokenizer("abcdefQ", return_tensors="pt", add_special_tokens=False)["input_ids"]
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    drafter = ScriptedDrafter.from_target(target, block_size=4).eval().rig(target, plain, error_rate=0.2)
    updates = list(compare_stream(target, tokenizer, drafter, "abcdef", 24))
    plain_text, blocks, stats_md, _ = updates[-1]
    assert plain_text == tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)
    stats = drafter.last_stats
    assert blocks.count('class="round ') == stats.target_forwards  # one span per verify round
    assert f"**block size** {stats.block_size}" in stats_md and "speedup" in stats_md
    assert len(updates) > stats.target_forwards  # streamed, not all at the end


def test_compare_stream_marks_rounds_the_controller_cut_short():
    from hf_blockpilot import AdaptiveVerify, CostModel
    from hf_blockpilot.controllers import AcceptanceModel

    target, tokenizer = _pair()
    ids = tokenizer("abcdefQ", return_tensors="pt", add_special_tokens=False)["input_ids"]
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    drafter = ScriptedDrafter.from_target(target, block_size=8).eval()
    drafter.rig(target, plain, error_rate=0.3, varied_confidence=True)
    steep = CostModel(target_ms={1: 50.0, 8: 300.0}, drafter_ms={8: 5.0})
    controller = AdaptiveVerify(8, acceptance=AcceptanceModel([-1.0], [1.0], [0.0]), cost_model=steep)
    plain_text, blocks, stats_md, _ = list(compare_stream(target, tokenizer, drafter, "abcdef", 24, controller))[-1]
    stats = drafter.last_stats
    cut = sum(d < w - 1 for d, w in zip(stats.drafted_per_round, stats.widths_per_round) if w > 1)
    assert cut > 0 and blocks.count(" truncated") == cut
    assert "drafts verified / round" in stats_md and "adaptive(b=8" in stats_md
    assert f"{stats.widths_per_round[1] - 1} drafted, {stats.drafted_per_round[1]} verified" in blocks


def test_rounds_html_marks_the_bonus_token():
    tokenizer = char_tokenizer(VOCAB)
    out = rounds_html(tokenizer, [[1, 2, 3], [4]])
    assert 'class="round round-0"' in out and 'class="round round-1"' in out
    assert 'class="bonus" style="text-decoration: underline; font-weight: 600">c</span>' in out
    assert 'class="bonus" style="text-decoration: underline; font-weight: 600">d</span>' in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_demo_in_a_real_browser(tmp_path):
    pytest.importorskip("gradio")
    playwright = pytest.importorskip("playwright.sync_api")
    from hf_blockpilot.tools.demo import build_demo

    target, tokenizer = _pair()
    ids = tokenizer("helloQ", return_tensors="pt", add_special_tokens=False)["input_ids"]
    plain = target.generate(ids, max_new_tokens=128, do_sample=False)  # the app's default max new tokens
    drafter = ScriptedDrafter.from_target(target, block_size=4).eval().rig(target, plain, error_rate=0.1)
    port = _free_port()
    demo = build_demo(target, tokenizer, drafter)
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=[
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
            page.locator("#prompt textarea").fill("hello")
            page.locator("#run").click()
            page.wait_for_selector("#stats :text('speedup')", timeout=60_000)
            stats = page.locator("#stats").inner_text()
            rounds = int(re.search(r"rounds (\d+)", stats).group(1))  # the request's verify rounds, prefill included
            assert page.locator("#blockpilot-output .round").count() == rounds > 1
            assert page.locator("#blockpilot-output .bonus").count() >= 1
            expected = tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)
            assert page.locator("#plain-output textarea").input_value() == expected
            assert "block size" in stats and "τ" in stats
            page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
            shot = os.environ.get("HF_BLOCKPILOT_SCREENSHOT")
            if shot:
                page.screenshot(path=shot, full_page=True)
            browser.close()
    finally:
        demo.close()
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def _count_new_tokens_of_each_generate(target) -> list[int]:
    """A list that gets the number of new tokens of each `target.generate` call as it returns."""
    counts: list[int] = []
    real_generate = target.generate

    def spy(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        counts.append(out.shape[1] - kwargs["inputs"].shape[1])
        return out

    target.generate = spy
    return counts


def test_an_abandoned_stream_stops_generation():
    """A client that disconnects mid-stream (Gradio then stops iterating and closes the job's generator) must
    not leave `generate` running to max_new_tokens."""
    target, tokenizer = _pair()
    drafter = make_drafter(target, block_size=4)
    calls = _count_new_tokens_of_each_generate(target)
    stream = compare_stream(target, tokenizer, drafter, "abcdef", 400)
    next(stream)  # the plain side has started streaming
    before = threading.active_count()
    stream.close()  # what Gradio's cancellation amounts to
    deadline = time.time() + 10
    while not calls and time.time() < deadline:
        time.sleep(0.01)
    assert calls and calls[0] < 400, "generate ran on after the client left"
    while threading.active_count() >= before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() < before  # the decoding thread ended


def test_the_demo_queue_is_bounded():
    pytest.importorskip("gradio")
    from hf_blockpilot.tools.demo import MAX_QUEUED, build_demo

    target, tokenizer = _pair()
    demo = build_demo(target, tokenizer, make_drafter(target, block_size=4))
    assert demo._queue.max_size == MAX_QUEUED


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_a_client_that_disconnects_mid_stream_stops_generation():
    pytest.importorskip("gradio")
    playwright = pytest.importorskip("playwright.sync_api")
    from hf_blockpilot.tools.demo import build_demo

    target, tokenizer = _pair()
    slow = target.register_forward_pre_hook(lambda module, args: time.sleep(0.03))  # ~30 tokens/s
    drafter = make_drafter(target, block_size=4)
    finished = _count_new_tokens_of_each_generate(target)
    port = _free_port()
    demo = build_demo(target, tokenizer, drafter)
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
            page.locator("#prompt textarea").fill("hello")
            page.locator("#run").click()
            page.wait_for_function("document.querySelector('#plain-output textarea').value.length > 3", timeout=30_000)
            browser.close()  # the client goes away mid-stream (128 tokens would take about 4 s)
        deadline = time.time() + 15
        while not finished and time.time() < deadline:
            time.sleep(0.05)
        assert finished and finished[0] < 100, f"generate ran on after the client left: {finished}"
        time.sleep(1.0)
        assert len(finished) == 1, "the BlockPilot side started although the client had left"
    finally:
        demo.close()
        slow.remove()


def test_policy_scores_fit_a_label_whatever_the_policy_reports():
    assert policy_scores({1: 0.25, 4: 0.75}, predicts_tau=False) == {"b=1": 0.25, "b=4": 0.75}
    assert policy_scores({1: 1.0, 4: 2.0, 8: 2.5}, predicts_tau=True) == {"b=1": 0.4, "b=4": 0.8, "b=8": 1.0}
    assert policy_scores(None, predicts_tau=True) == {}
