"""The package's `evaluate` metric, loaded by path offline, on real decoding outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import ScriptedDrafter, make_target

import hf_blockpilot.metrics


def test_speculative_decoding_metric_on_real_outputs(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = hf_blockpilot.metrics.load("speculative_decoding")
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=1)
    predictions, references, forwards = [], [], []
    for seed in range(3):
        prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
        drafter = ScriptedDrafter.from_target(target, block_size=4).eval().rig(target, plain, error_rate=0.2)
        fast = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        predictions.append(fast[0, 6:].tolist())
        references.append(plain[0, 6:].tolist())
        forwards.append(drafter.last_stats.target_forwards)
    result = metric.compute(
        predictions=predictions,
        references=references,
        target_forwards=forwards,
        seconds=[1.0, 1.0, 1.0],
        reference_seconds=[2.0, 2.0, 2.0],
    )
    assert result["exact_match"] == 1.0
    assert result["tau"] == pytest.approx(48 / sum(forwards)) and result["tau"] > 1.0
    assert result["speedup"] == pytest.approx(2.0)
    bad = metric.compute(predictions=[[1, 2]], references=[[1, 3]])
    assert bad == {"exact_match": 0.0}
    with pytest.raises(ValueError, match="unknown metric"):
        hf_blockpilot.metrics.load("bleu")
