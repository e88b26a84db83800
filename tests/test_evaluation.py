"""`measure_tau` pools the real decoding statistics; `decode_methods` times only warmed-up paths, round-robin,
and on the cost model's clock when given one."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import torch
from conftest import ScriptedDrafter, char_tokenizer, make_target

from hf_blockpilot._compat import decode_dtypes
from hf_blockpilot.costs import PRIOR_ACCEPTANCE
from hf_blockpilot.data import PromptRecord, chat_inputs
from hf_blockpilot.tools.bench import markdown_report
from hf_blockpilot.tools.evaluation import decode_methods, measure_tau, round_oracle_ms, summarize_methods


def test_measure_tau_pools_the_generators_statistics():
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    tokenizer = char_tokenizer(48)
    prompts = [PromptRecord(f"p{i}", "toy", "abcab") for i in range(2)]
    input_ids = chat_inputs(tokenizer, prompts[0].prompt, "cpu")
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    # an always-right drafter, so that τ differs by block size (about b) and pooling mistakes show
    drafter = ScriptedDrafter.from_target(target, block_size=4).eval().rig(target, expected, error_rate=0.0)
    report = measure_tau(target, tokenizer, drafter, prompts, block_sizes=(2, 4), max_new_tokens=12)

    assert report.dataset == "toy" and report.prompts == 2 and report.new_tokens == 24
    assert report.mismatches == {2: 0, 4: 0}
    assert drafter.block_size == 4  # restored
    for b in (2, 4):
        tokens = forwards = committed = rounds = 0
        drafter.block_size = b
        for _ in prompts:  # the same text twice, as measure_tau decoded it
            target.generate(input_ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
            stats = drafter.last_stats
            tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forwards
            committed += sum(stats.committed_per_draft_round)
            rounds += len(stats.committed_per_draft_round)
        assert report.tau[b] == tokens / forwards
        assert report.acceptance_length[b] == committed / rounds
    assert 1.5 < report.tau[2] < 2.0 and report.tau[4] >= 3.0


class _SlowFirstCallPolicy(torch.nn.Module):
    """Picks b = 2; its first call takes 0.3 s, like lazy kernel set-up on a fresh CUDA context."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def check_compatible(self, target, drafter):
        pass

    def choose_block_size(self, prefill_outputs, target_head, temperature):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.3)
        return 2, None


def _toy_decoding_setup():
    """A tiny target, a character tokenizer, one prompt and a scripted drafter that is right 70% of the time."""
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    tokenizer = char_tokenizer(48)
    prompts = [PromptRecord("p0", "toy", "abcab")]
    expected = target.generate(chat_inputs(tokenizer, prompts[0].prompt, "cpu"), max_new_tokens=6, do_sample=False)
    drafter = ScriptedDrafter.from_target(target, block_size=4).eval().rig(target, expected, error_rate=0.3)
    return target, tokenizer, prompts, drafter


def test_decode_methods_warms_up_the_policy_path_before_timing():
    target, tokenizer, prompts, drafter = _toy_decoding_setup()
    policy = _SlowFirstCallPolicy()
    results = decode_methods(
        target, tokenizer, drafter, prompts, block_sizes=(4,), policy=policy, max_new_tokens=6, repeats=1
    )

    timed = [r for r in results if r.method == "policy"]
    assert policy.calls == 2  # warm-up + the timed run
    assert len(timed) == 1 and timed[0].block_size == 2 and timed[0].policy_seconds < 0.1
    assert drafter.policy is None and drafter.block_size == 4  # restored


def test_decode_methods_interleaves_the_methods_across_repeats(monkeypatch):
    from hf_blockpilot.tools import evaluation

    target, tokenizer, prompts, drafter = _toy_decoding_setup()
    order = []
    real = evaluation.timed_generate

    def spy(target, input_ids, drafter=None, **kwargs):
        if kwargs.get("max_new_tokens") == 6:  # the timed runs (warm-up runs take 4 tokens)
            controller = kwargs.get("draft_controller")
            order.append(str(next(target.parameters()).dtype) if drafter is None else controller.describe())
        return real(target, input_ids, drafter, **kwargs)

    monkeypatch.setattr(evaluation, "timed_generate", spy)
    results = decode_methods(
        target,
        tokenizer,
        drafter,
        prompts,
        block_sizes=(2, 4),
        policy=_SlowFirstCallPolicy(),
        max_new_tokens=6,
        repeats=3,
    )
    # round-robin, not all repeats of one method in a row; `default` is what generate runs with no controller
    plains = ["torch.float32"] + [str(d) for d in decode_dtypes("cpu") if d != torch.float32]
    assert order == [*plains, "fixed(b=2)", "fixed(b=4)", "policy", "guarded(fixed(b=4))"] * 3
    other = [f"plain {d.removeprefix('torch.')}" for d in plains[1:]]
    assert [r.method for r in results] == ["plain", *other, "b=2", "b=4", "policy", "default"]
    assert all(r.identical_to_plain for r in results if r.method not in other)


def test_decode_methods_times_every_method_on_the_cost_model_too(monkeypatch):
    """With a cost model each result carries its rounds' modeled time, each fixed b the per-round oracle's, and
    the summary compares them on that clock (the per-prompt oracle picking by modeled time)."""
    from hf_blockpilot.controllers import AdaptiveVerify
    from hf_blockpilot.costs import CostModel
    from hf_blockpilot.tools import evaluation

    target, tokenizer, prompts, drafter = _toy_decoding_setup()
    prompts = prompts + [PromptRecord("p1", "toy", "cabbage")]
    cost = CostModel(target_ms={1: 10.0, 2: 11.0, 4: 13.0}, drafter_ms={2: 1.0, 4: 2.0})
    stats = {}
    real = evaluation.method_result

    def keep_stats(prompt_id, method, out, prompt_tokens, seconds, stats_, *args, **kwargs):
        stats[prompt_id, method] = stats_
        return real(prompt_id, method, out, prompt_tokens, seconds, stats_, *args, **kwargs)

    monkeypatch.setattr(evaluation, "method_result", keep_stats)
    results = decode_methods(
        target,
        tokenizer,
        drafter,
        prompts,
        block_sizes=(2, 4),
        max_new_tokens=6,
        controllers={"adaptive": AdaptiveVerify(4, cost_model=cost)},
        cost_model=cost,
    )
    for r in results:
        s = stats[r.prompt_id, r.method]
        if r.method.startswith("plain"):  # in the target's dtype, or another native one
            assert r.modeled_seconds == pytest.approx(r.new_tokens * 10.0 / 1000) and r.round_oracle_seconds is None
            continue
        assert r.modeled_seconds == pytest.approx(cost.modeled_decode_ms(s) / 1000)
        if r.method.startswith("b="):
            assert r.round_oracle_seconds == pytest.approx(round_oracle_ms(cost, s) / 1000)
            assert r.round_oracle_seconds <= r.modeled_seconds
        else:
            assert r.round_oracle_seconds is None
    summary = evaluation.summarize_methods(results)

    def speedup(rows, clock):
        plain = [r for r in results if r.method == "plain"]
        return (sum(r.new_tokens for r in rows) / sum(getattr(r, clock) for r in rows)) / (
            sum(r.new_tokens for r in plain) / sum(r.modeled_seconds for r in plain)
        )

    for method in ("b=2", "b=4", "adaptive"):
        rows = [r for r in results if r.method == method]
        assert summary[method]["modeled_speedup"] == pytest.approx(speedup(rows, "modeled_seconds"))
    assert summary["b=4"]["round_oracle_speedup"] == pytest.approx(
        speedup([r for r in results if r.method == "b=4"], "round_oracle_seconds")
    )
    assert "round_oracle_speedup" not in summary["adaptive"]
    best = [
        min(
            (r for r in results if r.prompt_id == p and (r.method == "plain" or r.method.startswith("b="))),
            key=lambda r: r.modeled_seconds,
        )
        for p in ("p0", "p1")
    ]
    assert summary["oracle"]["modeled_speedup"] == pytest.approx(speedup(best, "modeled_seconds"))
    assert summary["plain"]["modeled_speedup"] == 1.0


def test_compare_with_plain_pairs_each_round_and_alternates_the_order(monkeypatch):
    """Each round times every side back to back, the order reversed every other round, and a speedup is the median
    of the rounds' own ratios: a host that slows down between rounds moves both sides of a round alike."""
    from hf_blockpilot.tools import evaluation

    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    input_ids = torch.tensor([[1, 2, 3]])
    new_tokens = 10
    order: list[str] = []
    # the host's speed, one value a run: drifting between rounds, and once within a round
    slowdown = iter([1.0, 1.0, 3.0, 3.0, 1.2, 2.0])

    def scripted(model, ids, drafter=None, **kwargs):
        side = "ours" if drafter is not None else "plain"
        sequences = torch.zeros(1, ids.shape[1] + kwargs["max_new_tokens"], dtype=torch.long)
        if kwargs["max_new_tokens"] != new_tokens:  # the warm-up
            return evaluation.TimedRun(sequences, 1.0, None)
        order.append(side)
        seconds = (0.8 if side == "ours" else 1.0) * next(slowdown)  # ours 1.25x plain in two rounds of three
        return evaluation.TimedRun(sequences, seconds, None)

    monkeypatch.setattr(evaluation, "timed_generate", scripted)
    monkeypatch.setattr(evaluation, "plain_in_other_dtypes", lambda target: {})
    gen = dict(max_new_tokens=new_tokens, do_sample=False)
    answer = torch.zeros(1, 3 + new_tokens, dtype=torch.long)
    result = evaluation.compare_with_plain(target, input_ids, object(), None, gen, 3, answer)

    assert order == ["ours", "plain", "plain", "ours", "ours", "plain"]
    assert result["speedup"] == pytest.approx(1.25) and result["speedup_vs_fastest_plain"] == pytest.approx(1.25)
    # the ratio of the sides' median runs would be 2.08: ours' median run (10.4 tokens/s) over plain's (5.0)
    assert result["plain_tokens_per_second"] == pytest.approx(new_tokens / 2.0, abs=0.01)
    assert result["speculative_tokens_per_second"] == pytest.approx(new_tokens / 0.96, abs=0.01)
    assert result["identical_to_plain"] is True


def test_decode_methods_runs_auto_in_the_dtype_generate_would_pick_per_prompt(monkeypatch):
    """`auto` is the default in the dtype `preferred_dtype` picks for each prompt (asked with its length, the
    answer's budget and the pair already in every dtype), and its output is held to plain in that dtype."""
    from hf_blockpilot.tools import evaluation

    target, tokenizer, prompts, drafter = _toy_decoding_setup()
    prompts = prompts + [PromptRecord("long", "toy", "cabbage" * 4)]
    lengths = {r.id: chat_inputs(tokenizer, r.prompt, "cpu").shape[1] for r in prompts}
    asked, ran, compared, outputs = [], {}, {}, {}

    def preferred(target_, drafter_, prompt_tokens, new_tokens, copies, temperature, acceptance):
        asked.append((prompt_tokens, new_tokens, sorted(map(str, copies))))
        assert temperature == 0.0 and acceptance == PRIOR_ACCEPTANCE  # greedy, and no τ policy: the prior
        assert all(next(pair[1].parameters()).dtype == dtype for dtype, pair in copies.items())
        return torch.bfloat16 if prompt_tokens < max(lengths.values()) else torch.float32

    real_generate, real_result = evaluation.timed_generate, evaluation.method_result

    def spy(target_, input_ids, drafter_=None, **kwargs):
        if drafter_ is not None and kwargs.get("max_new_tokens") == 6:
            ran.setdefault(input_ids.shape[1], set()).add((target_.dtype, next(drafter_.parameters()).dtype))
        return real_generate(target_, input_ids, drafter_, **kwargs)

    def keep(prompt_id, method, out, prompt_tokens, seconds, stats, plain, *args, **kwargs):
        outputs[prompt_id, method], compared[prompt_id, method] = out, plain
        return real_result(prompt_id, method, out, prompt_tokens, seconds, stats, plain, *args, **kwargs)

    monkeypatch.setattr(evaluation, "preferred_dtype", preferred)
    monkeypatch.setattr(evaluation, "timed_generate", spy)
    monkeypatch.setattr(evaluation, "method_result", keep)
    results = decode_methods(
        target, tokenizer, drafter, prompts, block_sizes=(2,), max_new_tokens=6, repeats=1, auto_dtype=True
    )
    assert asked == [(lengths[r.id], 6, ["torch.bfloat16", "torch.float32"]) for r in prompts]
    assert [r.method for r in results if r.prompt_id == "p0"] == ["plain", "plain bfloat16", "b=2", "default", "auto"]
    # p0 (short) ran in bfloat16 beside the float32 methods; the long one only in float32
    assert ran[lengths["p0"]] == {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)}
    assert ran[lengths["long"]] == {(torch.float32, torch.float32)}
    assert compared["p0", "auto"] is outputs["p0", "plain bfloat16"]
    assert compared["long", "auto"] is outputs["long", "plain"]
    assert compared["p0", "default"] is outputs["p0", "plain"] and compared["p0", "plain bfloat16"] is None
    assert all(r.identical_to_plain for r in results if r.method != "plain bfloat16")
    assert next(drafter.parameters()).dtype == torch.float32  # the user's drafter was copied, not converted
    ran_in = {(r.prompt_id, r.method): r.dtype for r in results}
    assert ran_in["p0", "auto"] == "bfloat16" and ran_in["long", "auto"] == "float32"
    assert (
        ran_in["p0", "plain bfloat16"] == "bfloat16" and ran_in["p0", "default"] == ran_in["p0", "plain"] == "float32"
    )
    # the bench's table says which dtypes `auto` ran in
    run = {"dataset": "toy", "temperature": 0.0, "summary": summarize_methods(results)}
    run["results"] = [asdict(r) for r in results]
    report = {"machine": {"cpu": "x", "cpu_threads": 2, "device": "cpu", "torch": "t", "transformers": "t"}}
    report |= {"settings": {"prompt_lookup": False}, "runs": [run]}
    assert "here bfloat16 1x, float32 1x)" in markdown_report(report)
