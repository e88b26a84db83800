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


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_the_embedded_policy_predicts_acceptance_and_prices_it_with_the_given_costs(default_pair, prompt_lookup):
    """Each embedded policy predicts τ(b) per prompt (it must depend on the prompt, stay within 1..b, and fall
    when sampling, which lowers acceptance) and weighs it against the cost model it is given: the same prefills
    choose wider blocks under the shipped H100 table (a 16-token verify costs about one plain step) than under the
    shipped AMD EPYC float32 table (a wide verify costs up to two)."""
    from hf_blockpilot import CostModel
    from hf_blockpilot.data import load_prompts

    target, tokenizer = default_pair
    policy = resolve_policy("default", prompt_lookup=prompt_lookup)
    assert policy.objective == "tau" and policy.serving_controller == "fixed"
    flat, steep = CostModel.default_for("cuda"), CostModel.default_for("cpu")
    assert flat.round_ms(16) / flat.round_ms(1) < 1.5 < steep.round_ms(16) / steep.round_ms(1)
    head = target.get_output_embeddings()
    records = load_prompts("humaneval", 3) + load_prompts("mtbench", 4) + load_prompts("gsm8k", 3)
    widths, taus = {"flat": [], "steep": []}, []
    for record in records:
        ids = chat_inputs(tokenizer, record.prompt, target.device)
        with torch.no_grad():
            out = target(ids, output_hidden_states=True, logits_to_keep=1)
        for name, cost in (("flat", flat), ("steep", steep)):
            b, tau = policy.choose_block_size(out, head, cost_model=cost)
            widths[name].append(b)
        _, hot = policy.choose_block_size(out, head, temperature=1.0, cost_model=steep)
        assert tau[1] == 1.0 and all(1.0 <= tau[b] <= b for b in policy.candidates), tau
        widest = max(policy.candidates)
        assert hot[widest] < tau[widest], (record.id, tau, hot)
        taus.append(torch.tensor([tau[b] for b in policy.candidates]))
    spread = torch.stack(taus).std(dim=0).max().item()
    assert spread > 0.01, f"the policy predicts the same τ(b) for every prompt (max std {spread:.4f})"
    assert sum(widths["flat"]) > sum(widths["steep"]), widths
    assert any(f != s for f, s in zip(widths["flat"], widths["steep"])), widths


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


def test_one_prompt_through_the_batched_loop_decodes_as_plain_in_bfloat16(default_pair):  # noqa: ARG001
    """`custom_generate=hf_blockpilot.generate` runs the batched loop for one prompt too: its row must take the
    attention mask plain decoding takes. A 4-D mask sent bfloat16 SDPA down another kernel, and this MT-Bench
    answer left plain decoding's at token 25 (decoded plain throughout, so the drafts played no part)."""
    import hf_blockpilot
    from hf_blockpilot import CostModel, DraftController, SpeculationGuard
    from hf_blockpilot.data import load_prompts
    from hf_blockpilot.tools.loading import load_default_target

    target, tokenizer = load_default_target(dtype=torch.bfloat16)
    drafter = resolve_drafter(dtype=torch.bfloat16)
    drafter.set_policy(resolve_policy("default"))
    ids = chat_inputs(tokenizer, load_prompts("mtbench", 3)[2].prompt, target.device)
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    # costs where no draft can pay: the guard decodes the request plain, every step through the batched loop
    plain_only = SpeculationGuard(DraftController(4), timing="modeled")
    plain_only.use_cost_model(CostModel(target_ms={1: 10.0, 2: 40.0, 8: 160.0}, drafter_ms={2: 5.0, 8: 5.0}))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the machine runs it (the tests' one thread rounded both kernels alike)
    try:
        plain = target.generate(ids, **settings)
        ours = target.generate(
            ids, custom_generate=hf_blockpilot.generate, drafter=drafter, draft_controller=plain_only, **settings
        )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ours, plain)
    assert drafter.last_stats.drafter_forwards == 0  # every step a plain one
