"""The embedded default (SmolLM2-135M-Instruct + its trained drafter and BlockPilot policy), for real."""

from __future__ import annotations

import json

import pytest
import torch

from hf_blockpilot.data import chat_inputs
from hf_blockpilot.tools.loading import (
    DEFAULT_DRAFTER_DIR,
    DEFAULT_LOOKUP_POLICY_DIR,
    DEFAULT_POLICY_DIR,
    resolve_drafter,
    resolve_policy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_pair():
    pytest.importorskip("gguf", reason="the embedded default target needs the `gguf` package")
    from hf_blockpilot.tools.loading import load_default_target

    try:
        target, tokenizer = load_default_target()
    except FileNotFoundError as err:
        pytest.skip(f"embedded default target unavailable: {err}")
    return target, tokenizer


def test_embedded_assets_are_small_and_complete():
    drafter_bytes = sum(p.stat().st_size for p in DEFAULT_DRAFTER_DIR.iterdir())
    assert drafter_bytes < 40e6
    config = json.loads((DEFAULT_DRAFTER_DIR / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dtype"] in ("bfloat16", "float16")
    assert (DEFAULT_DRAFTER_DIR / "README.md").exists()
    for policy_dir in (DEFAULT_POLICY_DIR, DEFAULT_LOOKUP_POLICY_DIR):
        assert sum(p.stat().st_size for p in policy_dir.iterdir()) < 5e6
        assert {p.name for p in policy_dir.iterdir()} == {"README.md", "config.json", "model.safetensors"}


def test_the_default_policy_matches_the_prompt_lookup_setting():
    """Each embedded policy was trained on labels of decoding with prompt lookup off / on, for the embedded pair."""
    plain, lookup = resolve_policy("default"), resolve_policy("default", prompt_lookup=True)
    assert (plain.prompt_lookup, lookup.prompt_lookup) == (False, True)
    assert plain.drafter_fingerprint == lookup.drafter_fingerprint
    assert "| prompt lookup | on" in (DEFAULT_LOOKUP_POLICY_DIR / "README.md").read_text()


def test_default_drafter_is_lossless_and_drafts_usefully(default_pair):
    target, tokenizer = default_pair
    drafter = resolve_drafter()
    drafter.block_size = 8
    ids = chat_inputs(tokenizer, "Write a Python function that reverses a list.", target.device)
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    fast = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False, assistant_model=drafter
    )
    assert torch.equal(plain, fast)
    assert drafter.last_stats.tau > 1.2  # a trained drafter, not noise


def test_policy_reads_the_prompt_and_follows_its_labels(default_pair):
    """The embedded policy's probabilities must depend on the prompt (a constant function would be a defect). It
    was trained on composed labels (rounds cut by `AdaptiveVerify`, as it serves), which on this CPU say width 4
    for most prompts at T=0 and T=1 (a 4-token verify costs about one plain step; the per-round cut recovers
    most of what wider blocks lose, so they come close): every choice should be 4, and sampling, which lowers
    acceptance, should lower the weight on the widest block."""
    target, tokenizer = default_pair
    policy = resolve_policy("default")
    assert policy is not None and policy.label_controller == "adaptive"
    from hf_blockpilot.data import load_prompts

    records = load_prompts("humaneval", 3) + load_prompts("mtbench", 4) + load_prompts("gsm8k", 3)
    widest = max(policy.candidates)
    chosen, hot, probs = {}, {}, []
    for record in records:
        ids = chat_inputs(tokenizer, record.prompt, target.device)
        with torch.no_grad():
            out = target(ids, output_hidden_states=True, logits_to_keep=1)
        b, p = policy.choose_block_size(out, target.get_output_embeddings())
        assert b == max(p, key=p.get)
        hot_b, hot_p = policy.choose_block_size(out, target.get_output_embeddings(), temperature=1.0)
        chosen[record.id], hot[record.id] = b, hot_b
        assert hot_p[widest] < p[widest], (record.id, p, hot_p)
        probs.append(torch.tensor([p[c] for c in policy.candidates]))
    spread = torch.stack(probs).std(dim=0).max().item()
    assert spread > 0.01, f"the policy gives the same probabilities for every prompt (max std {spread:.4f})"
    assert set(chosen.values()) == set(hot.values()) == {4}, (chosen, hot)


def test_generate_command_uses_the_embedded_policy(default_pair, capsys):
    from hf_blockpilot.cli import main

    assert main(["generate", "Name a color.", "--max-new-tokens", "16", "--compare", "--no-stream", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_to_plain"] is True
    assert result["block_size"] in resolve_policy("default").candidates


def test_generate_with_prompt_lookup_uses_the_lookup_policy(default_pair, capsys):
    import warnings

    from hf_blockpilot.cli import main

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*prompt lookup.*")  # a policy for the other setting would warn
        assert (
            main(
                [
                    "generate",
                    "Name a color.",
                    "--max-new-tokens",
                    "16",
                    "--compare",
                    "--no-stream",
                    "--json",
                    "--prompt-lookup",
                ]
            )
            == 0
        )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_to_plain"] is True and "lookup_rounds" in result
    assert result["block_size"] in resolve_policy("default", prompt_lookup=True).candidates
