"""`measure_tau` pools the real decoding statistics; `decode_methods` times only warmed-up paths, round-robin."""

from __future__ import annotations

import time

import torch
from conftest import ScriptedDrafter, char_tokenizer, make_target

from hf_blockpilot.data import PromptRecord
from hf_blockpilot.data import chat_inputs
from hf_blockpilot.tools.evaluation import decode_methods, measure_tau


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
    results = decode_methods(target, tokenizer, drafter, prompts, block_sizes=(4,), policy=policy,
                             max_new_tokens=6, repeats=1)

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
            order.append("plain" if drafter is None else controller.describe().replace("fixed(b=", "b=").rstrip(")"))
        return real(target, input_ids, drafter, **kwargs)

    monkeypatch.setattr(evaluation, "timed_generate", spy)
    results = decode_methods(target, tokenizer, drafter, prompts, block_sizes=(2, 4), policy=_SlowFirstCallPolicy(),
                             max_new_tokens=6, repeats=3)
    assert order == ["plain", "b=2", "b=4", "policy"] * 3  # round-robin, not all repeats of one method in a row
    assert [r.method for r in results] == ["plain", "b=2", "b=4", "policy"]
    assert all(r.identical_to_plain for r in results)
