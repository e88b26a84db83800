"""Drafter model card: architecture facts and measured τ rendered from the template."""

from __future__ import annotations

from conftest import make_drafter, make_target, make_windowed_drafter

from hf_blockpilot.tools.cards import drafter_model_card
from hf_blockpilot.tools.evaluation import TauReport


def test_drafter_card_reports_tau_per_block_size():
    target = make_target("llama", vocab_size=48, hidden_size=64)
    drafter = make_drafter(target, draft_vocab=list(range(40)))
    reports = [
        TauReport("humaneval", [4, 8], tau={4: 1.51, 8: 1.73}, mismatches={4: 0, 8: 0}, prompts=20),
        TauReport("mtbench", [4, 8], tau={4: 1.22, 8: 1.3}, mismatches={4: 0, 8: 0}, prompts=20),
    ]
    card = str(drafter_model_card(drafter, "tiny-dflash", "org/tiny", reports, "RECIPE", "TRAIN", "EVAL"))
    assert "base_model: org/tiny" in card and "library_name: hf-blockpilot" in card
    assert "| humaneval | 20 | 1.51 | 1.73 |" in card
    assert "| mtbench | 20 | 1.22 | 1.30 |" in card
    assert "40 target ids" in card and "mismatches: 0" in card
    assert "(Qwen3-style, non-causal over [target context ; block])" in card
    assert "RECIPE" in card and "TRAIN" in card and "EVAL" in card


def test_drafter_card_says_how_sliding_and_causal_layers_attend():
    target = make_target("llama", vocab_size=48, hidden_size=64)
    drafter = make_windowed_drafter(
        target, sliding_window=4, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2
    )
    reports = [TauReport("humaneval", [4], tau={4: 1.5}, mismatches={4: 0}, prompts=2)]
    card = str(drafter_model_card(drafter, "w", "org/tiny", reports, "R", "T", "E"))
    assert "layer 0: causal, window 4; layer 1: non-causal over [target context ; block]" in card
