"""BlockPilot policy: Hub round trips, strict loading, attaching, per-request choice from the prefill."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_drafter, make_target
from safetensors.torch import load_file, save_file

from hf_blockpilot import BlockDiffusionDrafter, BlockPilotPolicy
from hf_blockpilot.controllers import policy_state_indices
from hf_blockpilot.policy import (
    NUM_SCALAR_FEATURES,
    LastLogitsMLPPolicy,
    PrefillMLPPolicy,
    checked_feature_layers,
    drafter_fingerprint,
    prefill_features,
)

VOCAB, HIDDEN, LAYERS = 48, 64, 4


@pytest.fixture
def target():
    return make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)


def make_policy(target, drafter=None, candidates=(1, 3, 6), seed=0, prompt_lookup=False, **fields) -> BlockPilotPolicy:
    torch.manual_seed(seed)
    return PrefillMLPPolicy(
        candidates=list(candidates),
        feature_layers=[1, 3],
        target_hidden_size=HIDDEN,
        target_vocab_size=VOCAB,
        target_num_layers=LAYERS,
        width=16,
        target_name="tiny-qwen3",
        drafter_name="tiny-drafter",
        drafter_fingerprint=drafter_fingerprint(drafter) if drafter is not None else "",
        prompt_lookup=prompt_lookup,
        **fields,
    ).eval()


def rig_choice(policy: BlockPilotPolicy, index: int) -> BlockPilotPolicy:
    """Make the policy always pick candidate `index` (zero weights, biased output)."""
    with torch.no_grad():
        last = policy.net[-1]
        last.weight.zero_()
        last.bias.zero_()
        last.bias[index] = 5.0
    return policy


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0, **kwargs)


def _prompt(seed=0, length=7):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def test_round_trip_through_a_local_directory(tmp_path, target):
    policy = make_policy(target)
    policy.save_pretrained(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["candidates"] == [1, 3, 6] and config["feature_layers"] == [1, 3]
    assert config["target_name"] == "tiny-qwen3" and config["objective"] == "throughput"
    loaded = BlockPilotPolicy.from_pretrained(tmp_path / "p")
    for (name, a), b in zip(policy.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    features = torch.randn(3, 2 * 2 * HIDDEN + NUM_SCALAR_FEATURES)
    torch.testing.assert_close(loaded(features), policy(features))


def test_round_trip_through_the_offline_hub_cache(tmp_path, target):
    make_policy(target).save_pretrained(tmp_path / "p")
    snapshot = tmp_path / "hub" / "models--org--tiny-policy" / "snapshots" / ("a" * 40)
    shutil.copytree(tmp_path / "p", snapshot)
    (tmp_path / "hub" / "models--org--tiny-policy" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-policy" / "refs" / "main").write_text("a" * 40)
    code = (
        "from hf_blockpilot import BlockPilotPolicy\n"
        "p = BlockPilotPolicy.from_pretrained('org/tiny-policy')\n"
        "print(p.candidates)\n"
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[1, 3, 6]"


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_strict_loading_rejects_missing_or_extra_tensors(tmp_path, target, change):
    make_policy(target).save_pretrained(tmp_path / "p")
    path = tmp_path / "p" / "model.safetensors"
    tensors = load_file(str(path))
    if change == "missing":
        tensors.pop("input_norm.bias")
    else:
        tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="does not hold a BlockPilot policy"):
        BlockPilotPolicy.from_pretrained(tmp_path / "p")


def test_attach_by_directory_and_policy_picks_the_block_size(tmp_path, target):
    drafter = make_drafter(target, block_size=4)
    drafter.save_pretrained(tmp_path / "d")
    policy = rig_choice(make_policy(target, drafter), index=2)  # always 6
    policy.save_pretrained(tmp_path / "p")
    loaded = BlockDiffusionDrafter.from_pretrained(tmp_path / "d", policy=str(tmp_path / "p")).eval()
    assert isinstance(loaded.policy, BlockPilotPolicy)
    assert not any(k.startswith("policy") for k in loaded.state_dict()), "policy leaked into the drafter checkpoint"
    prompt = _prompt()
    assert torch.equal(_greedy(target, prompt, assistant_model=loaded), _greedy(target, prompt))
    stats = loaded.last_stats
    assert stats.block_size == 6 and max(stats.drafted_per_round) == 5
    assert stats.policy_probs is not None and max(stats.policy_probs, key=stats.policy_probs.get) == 6
    assert stats.policy_seconds > 0
    loaded.set_policy(None)
    _greedy(target, prompt, assistant_model=loaded)
    assert loaded.last_stats.block_size == 4 and loaded.last_stats.policy_probs is None


def test_block_size_one_turns_speculation_off(target):
    drafter = make_drafter(target, block_size=4)
    drafter.set_policy(rig_choice(make_policy(target, drafter), index=0))  # always 1
    prompt = _prompt(1)
    assert torch.equal(_greedy(target, prompt, assistant_model=drafter), _greedy(target, prompt))
    assert drafter.last_stats.block_size == 1
    assert drafter.last_stats.drafter_forwards == 0 and drafter.last_stats.tau == 1.0


def test_choices_vary_with_the_prompt_and_need_no_extra_target_forward(target):
    drafter = make_drafter(target, block_size=4)
    policy = make_policy(target, drafter, seed=3)
    with torch.no_grad():
        policy.net[-1].weight.mul_(50.0)  # a random but decisive policy
    drafter.set_policy(policy)
    calls = []
    hook = target.register_forward_hook(lambda *args: calls.append(1))
    chosen = set()
    for seed in range(12):
        prompt = _prompt(seed, length=3 + seed)
        calls.clear()
        _greedy(target, prompt, assistant_model=drafter)
        assert len(calls) == drafter.last_stats.target_forwards, "the policy must not add target forwards"
        chosen.add(drafter.last_stats.block_size)
    hook.remove()
    assert len(chosen) > 1, f"policy chose {chosen} for every prompt"


def test_features_come_from_the_prefill_outputs(target):
    prompt = _prompt(2, length=9)
    out = target(prompt, output_hidden_states=True)
    features = prefill_features(out, [1, 3], target.get_output_embeddings(), temperature=0.7)
    assert features.shape == (1, 2 * 2 * HIDDEN + NUM_SCALAR_FEATURES)
    torch.testing.assert_close(features[0, :HIDDEN], out.hidden_states[2][0, -1])
    torch.testing.assert_close(features[0, HIDDEN : 2 * HIDDEN], out.hidden_states[2][0].mean(0))
    probs = out.logits[0, -1].softmax(-1)  # the prefill's own last logits
    entropy = -(probs * probs.log()).sum()
    top2 = probs.topk(2).values
    torch.testing.assert_close(features[0, -5:-2], torch.stack([entropy, top2[0], top2[0] - top2[1]]))
    torch.testing.assert_close(features[0, -2:], torch.tensor([math.log(9), 0.7]))
    # outputs that carry only hidden states: the logits recomputed from the final one give the same features
    states_only = SimpleNamespace(hidden_states=out.hidden_states)
    head = target.get_output_embeddings()
    torch.testing.assert_close(prefill_features(states_only, [1, 3], head, temperature=0.7), features)


def test_the_policy_reads_the_prefill_logits_without_a_product_of_its_own(target):
    """The features' distribution is the prefill's: the output embeddings run once per target forward, never
    again for the policy."""
    drafter = make_drafter(target, block_size=4)
    drafter.set_policy(make_policy(target, drafter))
    calls = []
    hook = target.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    _greedy(target, _prompt(3), assistant_model=drafter)
    hook.remove()
    assert len(calls) == drafter.last_stats.target_forwards


def test_each_row_of_a_padded_batch_gives_the_policy_its_own_prefill(target):
    """Row by row, the policy sees what a call of that prompt alone shows it (its last real token's logits and
    its states without the left padding), to float tolerance (a batch's products round otherwise)."""
    drafter = make_drafter(target, block_size=4)
    policy = make_policy(target, drafter)
    seen = []
    policy.forward = lambda features: seen.append(features.clone()) or torch.zeros(features.shape[0], 3)
    drafter.set_policy(policy)
    prompts = [_prompt(4, length=9)[0], _prompt(5, length=6)[0]]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, 9 - len(prompt) :], mask[r, 9 - len(prompt) :] = prompt, 1
    target.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, assistant_model=drafter
    )
    head = target.get_output_embeddings()
    for features, prompt in zip(seen, prompts, strict=True):
        with torch.no_grad():
            alone = prefill_features(target(prompt[None], output_hidden_states=True), [1, 3], head)
        torch.testing.assert_close(features, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_do_not_depend_on_sampling_settings_or_dtype(dtype):
    """`generate` overwrites the prefill logits with its processed ones (temperature, top-k) for fp32 targets
    only; the features read the raw distribution either way, and carry the temperature on their own."""
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS).to(dtype)
    drafter = make_drafter(target, block_size=4).to(dtype)
    seen = []
    policy = make_policy(target, drafter).to(dtype)
    policy.forward = lambda features: seen.append(features.clone()) or torch.zeros(1, 3)
    drafter.set_policy(policy)
    prompt = _prompt(6)
    runs = [dict(do_sample=False), dict(do_sample=True, temperature=0.5, top_k=3), dict(do_sample=True, top_k=5)]
    for kwargs in runs:
        torch.manual_seed(0)
        target.generate(prompt, max_new_tokens=4, pad_token_id=0, assistant_model=drafter, **kwargs)
    reference = prefill_features(target(prompt, output_hidden_states=True), [1, 3], target.get_output_embeddings())
    for features, temperature in zip(seen, [0.0, 0.5, 1.0]):
        torch.testing.assert_close(features[0, :-1], reference[0, :-1].to(features.dtype))
        assert features[0, -1].item() == temperature


def test_attaching_to_another_target_errors_and_another_drafter_warns(target):
    drafter = make_drafter(target, block_size=4)
    policy = make_policy(target, drafter)
    other_target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=6, seed=0)
    other_drafter = make_drafter(other_target, block_size=4, seed=1)
    other_drafter.set_policy(policy)
    with pytest.raises(ValueError, match="trained for target tiny-qwen3"):
        _greedy(other_target, _prompt(), assistant_model=other_drafter)
    second = make_drafter(target, block_size=4, seed=5)
    second.set_policy(policy)
    with pytest.warns(UserWarning, match="trained for drafter tiny-drafter"):
        _greedy(target, _prompt(), assistant_model=second)


def test_a_classifier_tuned_for_another_device_warns_a_tau_policy_does_not(target):
    """A classifier learnt the best width under another device's costs; a τ policy weighs this machine's."""
    import warnings

    drafter = make_drafter(target, block_size=4)
    policy = make_policy(target, drafter)
    policy.report = {"cost_model_device": "cpu"}  # the device its training cost model was timed on
    drafter.set_policy(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same device: silent
        _greedy(target, _prompt(), assistant_model=drafter)
    policy.report = {"cost_model_device": "cuda:0"}
    with pytest.warns(UserWarning, match="measured on cuda:0, but the target runs on cpu.*--objective tau"):
        _greedy(target, _prompt(), assistant_model=drafter)
    policy.objective = "tau"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _greedy(target, _prompt(), assistant_model=drafter)


def test_a_policy_for_another_prompt_lookup_setting_warns(tmp_path, target):
    import warnings

    drafter = make_drafter(target, block_size=4)
    policy = make_policy(target, drafter)  # labels of decoding without prompt lookup
    drafter.set_policy(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same setting: silent
        _greedy(target, _prompt(), assistant_model=drafter)
    drafter.prompt_lookup = True
    with pytest.warns(
        UserWarning, match="prompt lookup off, but drafter.prompt_lookup is True.*collect --prompt-lookup"
    ):
        _greedy(target, _prompt(), assistant_model=drafter)
    make_policy(target, drafter, prompt_lookup=True).save_pretrained(tmp_path / "lookup")
    drafter.set_policy(BlockPilotPolicy.from_pretrained(tmp_path / "lookup"))
    assert drafter.policy.prompt_lookup is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _greedy(target, _prompt(), assistant_model=drafter)
    drafter.prompt_lookup = False
    with pytest.warns(UserWarning, match="prompt lookup on, but drafter.prompt_lookup is False"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_bad_candidates_are_rejected(target):
    with pytest.raises(ValueError, match="candidates"):
        make_policy(target, candidates=(0, 4))


def test_save_pretrained_writes_a_model_card_from_the_template(tmp_path, target):
    from dataclasses import asdict

    from hf_blockpilot.training.policy_training import PolicyReport

    hot = PolicyReport(
        accuracy=0.5,
        regret=0.2,
        policy_value=2.5,
        best_fixed_b=3,
        best_fixed_value=2.4,
        oracle_value=2.9,
        chosen={1: 0, 3: 20, 6: 0},
        validation_prompts=20,
    )
    report = PolicyReport(
        accuracy=0.75,
        regret=0.0123,
        policy_value=3.5,
        best_fixed_b=6,
        best_fixed_value=3.1,
        oracle_value=3.9,
        objective="throughput",
        validation_prompts=40,
        by_temperature={"1": asdict(hot)},
    )
    make_policy(target).save_pretrained(tmp_path / "first")
    policy = BlockPilotPolicy.from_pretrained(tmp_path / "first")
    assert policy.report is None
    torch.manual_seed(0)
    policy = PrefillMLPPolicy(
        **{**json.loads((tmp_path / "first" / "config.json").read_text()), "report": asdict(report)}
    )
    policy.save_pretrained(tmp_path / "p")
    reloaded = BlockPilotPolicy.from_pretrained(tmp_path / "p")  # the report survives the round trip
    assert reloaded.report["best_fixed_b"] == 6
    reloaded.save_pretrained(tmp_path / "again")
    card = (tmp_path / "again" / "README.md").read_text()
    assert "library_name: hf-blockpilot" in card
    assert "# BlockPilot policy for tiny-qwen3" in card
    assert "1, 3, 6" in card and "| accuracy vs per-prompt oracle b | 0.750 |" in card
    assert "| best fixed b | 6 (3.100) |" in card
    assert "| 1 | 2.500 | 3 (2.400) | 2.900 | b=3: 20 |" in card


def test_sampling_with_top_k_keeps_the_policy_features_finite(target):
    """At T>0 `generate` writes its processed logits (-inf outside top-k) into the prefill outputs the policy
    reads; the choice must still come from finite probabilities (it once silently fell back to b = 1)."""
    drafter = make_drafter(target, block_size=4)
    drafter.set_policy(rig_choice(make_policy(target, drafter), index=2))
    torch.manual_seed(0)
    target.generate(_prompt(4), max_new_tokens=12, do_sample=True, top_k=5, pad_token_id=0, assistant_model=drafter)
    probs = drafter.last_stats.policy_probs
    assert all(torch.isfinite(torch.tensor(p)) for p in probs.values()), probs
    assert drafter.last_stats.block_size == 6 and max(probs, key=probs.get) == 6


def test_non_finite_features_are_an_error_not_a_silent_choice(target):
    policy = make_policy(target)
    out = target(_prompt(5), output_hidden_states=True)
    out.hidden_states[2][0, -1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite prefill features"):
        policy.choose_block_size(out, target.get_output_embeddings())


def test_feature_layers_default_to_the_middle_and_second_to_last_and_are_checked():
    assert checked_feature_layers(make_target(layers=30), None) == [14, 28]  # the embedded policies' layers
    assert checked_feature_layers(make_target(layers=2), None) == [0]
    assert checked_feature_layers(make_target(layers=4), [3, 0]) == [3, 0]
    with pytest.raises(ValueError, match=r"the target has 4 layers, so ids 0\.\.3 \(out of range: \[4\]\)"):
        checked_feature_layers(make_target(layers=4), [1, 4])


def test_the_target_holds_only_the_hidden_states_the_drafter_and_policy_read(target):
    """Where Transformers keeps a selection at its positions (5.23), the loop asks for just those states, and
    the drafter's context and the policy's features are the same as from the full tuple."""
    from hf_blockpilot._compat import SELECTION_KEEPS_POSITIONS
    from hf_blockpilot.batched import hidden_states_to_keep
    from hf_blockpilot.controllers import resolve_controller

    drafter = make_drafter(target, block_size=4)
    drafter.set_policy(make_policy(target, drafter))
    ids = _prompt(length=9)
    keep = hidden_states_to_keep(drafter, resolve_controller(drafter))
    assert hidden_states_to_keep(drafter, resolve_controller(drafter), wants_all=True) is True
    if not SELECTION_KEEPS_POSITIONS:
        assert keep is True
        return
    assert keep == sorted({i + 1 for i in drafter.target_layer_ids} | {2, 4})  # and the policy's layers 1, 3
    with torch.no_grad():
        full, kept = target(ids, output_hidden_states=True), target(ids, output_hidden_states=keep)
    assert sum(h is not None for h in kept.hidden_states) < len(full.hidden_states)
    for i in drafter.target_layer_ids:
        assert torch.equal(kept.hidden_states[i + 1], full.hidden_states[i + 1])
    head = target.get_output_embeddings()
    assert torch.equal(prefill_features(kept, [1, 3], head), prefill_features(full, [1, 3], head))


def test_the_drafter_fingerprint_is_hashed_once_per_version_of_the_weight(target, monkeypatch):
    """`generate` checks it on every call with a policy; hashing copies the projection to the host each time."""
    from hf_blockpilot import policy as policy_module

    drafter = make_drafter(target)
    first = drafter_fingerprint(drafter)
    hashes = []
    real_sha256 = policy_module.hashlib.sha256
    monkeypatch.setattr(policy_module.hashlib, "sha256", lambda data: hashes.append(1) or real_sha256(data))
    assert drafter_fingerprint(drafter) == first and hashes == []  # cached
    with torch.no_grad():
        drafter.fc.weight[0, 0] += 1.0  # an in-place update (e.g. a training step)
    assert drafter_fingerprint(drafter) != first and len(hashes) == 1
    drafter.to(torch.float64)  # another tensor
    drafter_fingerprint(drafter)
    assert len(hashes) == 2
    with torch.inference_mode():
        frozen = make_drafter(target)
        assert drafter_fingerprint(frozen) == drafter_fingerprint(frozen) and len(hashes) == 4  # no version: rehash


FIXTURES = Path(__file__).parent / "fixtures" / "policies-0.1"


@pytest.mark.parametrize(
    ("architecture", "policy_class", "width"),
    [
        ("prefill-mlp", PrefillMLPPolicy, 2 * 2 * HIDDEN + NUM_SCALAR_FEATURES),
        ("last-logits-mlp", LastLogitsMLPPolicy, VOCAB),
    ],
)
def test_checkpoints_of_the_one_class_version_load_by_architecture_and_behave_as_before(
    architecture, policy_class, width
):
    """Checkpoints written when one class served both architectures (tests/fixtures/policies-0.1, with what
    they computed then) load as their architecture's class and give the same outputs and choices."""
    expected = json.loads((FIXTURES / "expected.json").read_text())[architecture]
    policy = BlockPilotPolicy.from_pretrained(FIXTURES / architecture)
    assert type(policy) is policy_class and policy.weighs_costs is False
    features = torch.randn(8, width, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        torch.testing.assert_close(policy(features), torch.tensor(expected["logits"]))
    assert [policy.candidates[i] for i in policy(features).argmax(1).tolist()] == expected["choices"]
    assert type(policy_class.from_pretrained(FIXTURES / architecture)) is policy_class
    other = LastLogitsMLPPolicy if policy_class is PrefillMLPPolicy else PrefillMLPPolicy
    with pytest.raises(
        ValueError, match=f"holds a {policy_class.__name__} \\({architecture}\\), not a {other.__name__}"
    ):
        other.from_pretrained(FIXTURES / architecture)
    # the target keeps only the hidden states it reads (the last-logits one: none, it reads the prefill's logits)
    assert policy_state_indices(policy) == ({2, 4} if architecture == "prefill-mlp" else set())
    # the served controller is what it was: the prefill one's labels were cut by AdaptiveVerify
    assert policy.serving_controller == ("adaptive" if architecture == "prefill-mlp" else "fixed")


def test_the_base_class_is_not_a_policy_and_configs_name_their_class(tmp_path, target):
    with pytest.raises(TypeError, match="construct PrefillMLPPolicy or LastLogitsMLPPolicy"):
        BlockPilotPolicy(candidates=[2, 4], target_vocab_size=VOCAB)
    with pytest.raises(ValueError, match="'last-logits-mlp' is LastLogitsMLPPolicy's, not PrefillMLPPolicy's"):
        PrefillMLPPolicy([2], [1], HIDDEN, VOCAB, LAYERS, architecture="last-logits-mlp")
    policy = make_policy(target)
    policy.save_pretrained(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["architecture"] == "prefill-mlp" and config["objective"] == "throughput"
    again = PrefillMLPPolicy(**config)  # a saved config round-trips through the constructor
    assert again.candidates == policy.candidates and again.label_controller == policy.label_controller
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="is not a BlockPilot policy checkpoint"):
        BlockPilotPolicy.from_pretrained(tmp_path / "target")
    (tmp_path / "p" / "config.json").write_text(json.dumps({**config, "width": 8}))
    with pytest.raises(ValueError, match=r"net.0.weight: \(16, 261\) in the file, \(8, 261\) for its config"):
        BlockPilotPolicy.from_pretrained(tmp_path / "p")
    (tmp_path / "p" / "config.json").write_text(json.dumps({**config, "architecture": "transformer"}))
    with pytest.raises(ValueError, match="architecture 'transformer'"):
        BlockPilotPolicy.from_pretrained(tmp_path / "p")


def _tau_policy(target, drafter, candidates=(1, 2, 4, 8), accept=0.8):
    """A τ-predicting policy whose prediction is the same for every prompt: τ(b) = 1 + accept (b - 1)."""
    policy = make_policy(target, drafter, candidates=candidates)
    policy.objective = "tau"
    with torch.no_grad():
        for module in (policy.net[-1], policy.scalar_head):
            module.weight.zero_()
            module.bias.zero_()
        policy.net[-1].bias.fill_(math.log(accept / (1 - accept)))
    return policy


def test_a_tau_policy_picks_wide_blocks_where_a_wide_verify_is_cheap_and_narrow_ones_where_not(target):
    """The same prefill, the same checkpoint: under a flat cost model (a 16-token verify about one plain step,
    as on a GPU or AMX in bf16) it picks the widest block, under a steep one (every token a plain step's cost, as
    float32 on a small CPU) a narrow one; greedy output equals plain decoding under both."""
    from hf_blockpilot import AdaptiveVerify, CostModel

    drafter = make_drafter(target, block_size=4)
    policy = _tau_policy(target, drafter)
    assert policy.weighs_costs and policy.serving_controller == "fixed"
    flat = CostModel(target_ms={1: 30.0, 8: 31.0}, drafter_ms={2: 2.0, 8: 2.5})
    steep = CostModel(target_ms={1: 30.0, 2: 40.0, 8: 240.0}, drafter_ms={2: 2.0, 8: 2.5})
    prompt = _prompt(3)
    expected = _greedy(target, prompt)
    widths = {}
    for name, cost in (("flat", flat), ("steep", steep)):
        out = _greedy(
            target, prompt, assistant_model=drafter, draft_controller=AdaptiveVerify(policy=policy, cost_model=cost)
        )
        assert torch.equal(out, expected)
        widths[name] = drafter.last_stats.block_size
        # the scores it reports are its predicted τ(b), whatever the costs
        assert drafter.last_stats.policy_probs == pytest.approx({1: 1.0, 2: 1.8, 4: 3.4, 8: 6.6}, rel=1e-5)
    assert widths == {"flat": 8, "steep": 2}
    out = policy.features(target(prompt, output_hidden_states=True), target.get_output_embeddings())
    assert out.shape[1] == 2 * 2 * HIDDEN + NUM_SCALAR_FEATURES


def test_a_tau_policy_is_served_by_default_with_this_machines_costs(target, monkeypatch):
    """With no controller passed, generate resolves this machine's cost model and the policy weighs it."""
    from hf_blockpilot import CostModel, custom_generate

    drafter = make_drafter(target, block_size=4)
    drafter.set_policy(_tau_policy(target, drafter))
    for cost, width in (
        (CostModel(target_ms={1: 30.0, 8: 31.0}, drafter_ms={2: 2.0, 8: 2.5}), 8),
        (CostModel(target_ms={1: 30.0, 2: 40.0, 8: 240.0}, drafter_ms={2: 2.0, 8: 2.5}), 2),
    ):
        monkeypatch.setattr(custom_generate, "resolve_cost_model", lambda *args, c=cost, **kwargs: c)
        out = _greedy(target, _prompt(4), assistant_model=drafter)
        assert torch.equal(out, _greedy(target, _prompt(4)))
        assert drafter.last_stats.block_size == width
        assert drafter.last_stats.controller == "guarded(policy)"


def test_a_tau_policys_width_is_corrected_by_the_requests_rounds(target):
    """The policy predicts τ(8) = 6.6 for every prompt and picks b = 8; this random drafter's drafts are rejected,
    so the request's later rounds draft narrower blocks; greedy output stays plain decoding's."""
    from hf_blockpilot import CostModel, PolicyBlockSize

    drafter = make_drafter(target, block_size=4)
    policy = _tau_policy(target, drafter)
    cost = CostModel(target_ms={1: 30.0, 2: 33.0, 8: 45.0}, drafter_ms={2: 2.0, 8: 2.5})
    prompt = _prompt(5)
    expected = _greedy(target, prompt)
    widths = {}
    for correct in (True, False):
        controller = PolicyBlockSize(policy, correct_width=correct)
        controller.use_cost_model(cost)
        assert torch.equal(_greedy(target, prompt, assistant_model=drafter, draft_controller=controller), expected)
        stats = drafter.last_stats
        assert stats.block_size == 8 and stats.tau < 1.5
        widths[correct] = [w for w in stats.widths_per_round[1:] if w > 1]
    assert widths[False][:8] == [8] * 8  # uncorrected: b = 8 until the room left before max_length shrinks it
    assert widths[True][0] == 8 and widths[True][7] < 8 and widths[True] == sorted(widths[True], reverse=True)


def test_a_tau_policy_drafts_only_where_it_predicts_a_clear_gain_over_plain(target):
    from hf_blockpilot.policy import MIN_PREDICTED_GAIN

    policy = _tau_policy(target, None)
    tau = torch.tensor([1.0, 1.8, 3.4, 6.6])
    for gain, expected in ((MIN_PREDICTED_GAIN / 2, 0), (MIN_PREDICTED_GAIN * 2, 1)):
        ms = torch.tensor([30.0, 1.8 * 30.0 / (1 + gain), 1e3, 1e3])
        assert int(policy.priced_choice(tau, ms)) == expected, gain
    batch = policy.priced_choice(torch.stack([tau, tau]), torch.tensor([[30.0, 1e3, 1e3, 1e3], [1e3, 1e3, 1e3, 30.0]]))
    assert batch.tolist() == [0, 3]


def test_a_tau_policy_needs_a_gain_above_its_own_held_out_error(target):
    """The margin over plain decoding is the policy's held-out τ error where that exceeds `MIN_PREDICTED_GAIN`."""
    from hf_blockpilot.policy import MIN_PREDICTED_GAIN

    policy = _tau_policy(target, None)
    tau = torch.tensor([1.0, 1.8, 3.4, 6.6])
    ms = torch.tensor([30.0, 1.8 * 30.0 / 1.10, 1e3, 1e3])  # b = 2 predicted 10 % faster than plain
    policy.report = None
    assert policy.drafting_margin() == MIN_PREDICTED_GAIN and int(policy.priced_choice(tau, ms)) == 1
    policy.report = {"tau_error": 0.15}
    assert policy.drafting_margin() == 0.15 and int(policy.priced_choice(tau, ms)) == 0
    policy.report = {"tau_error": 0.01}
    assert policy.drafting_margin() == MIN_PREDICTED_GAIN and int(policy.priced_choice(tau, ms)) == 1


def test_predicted_tau_is_made_consistent_across_widths(target):
    """τ(b) never falls as b grows and its gain per slot never grows nor exceeds 1; a consistent prediction is
    kept as it is."""
    policy = _tau_policy(target, None, candidates=(1, 2, 3, 4, 6, 8))
    consistent = torch.tensor([1.0, 1.8, 2.44, 2.95, 3.6, 4.0])
    assert torch.allclose(policy.consistent_tau(consistent), consistent)
    raw = torch.tensor([[1.0, 1.37, 2.18, 2.64, 1.89, 1.9], [1.0, 1.9, 2.2, 2.3, 3.5, 3.6]])
    fixed = policy.consistent_tau(raw)
    widths = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 8.0])
    gains = fixed.diff(dim=-1) / widths.diff()
    assert (gains >= 0).all() and (gains <= 1).all() and (gains.diff(dim=-1) <= 1e-6).all()
    assert (fixed <= torch.maximum(raw, fixed.cummax(dim=-1).values) + 1e-6).all()
    assert fixed[0].tolist() == pytest.approx([1.0, 1.37, 1.74, 2.11, 2.11, 2.11])  # τ(2) bounds the rest
    assert fixed[1].tolist() == pytest.approx([1.0, 1.9, 2.2, 2.3, 2.5, 2.7])  # τ(6) capped by τ(4)'s gain


def test_a_per_slot_head_sums_running_products_of_slot_acceptances(tmp_path, target):
    """τ(b) = 1 + Σ_{j<b} Π_{i<=j} α_i from one acceptance per draft slot: consistent across widths as it stands,
    and kept through save / load."""
    policy = make_policy(target, candidates=[1, 2, 3, 6], objective="tau", tau_head="per_slot")
    assert policy.num_outputs == 5 and policy.net[-1].out_features == 5
    alpha = torch.tensor([[0.9, 0.5, 0.8, 0.1, 0.5]])
    tau = policy.predicted_tau(torch.logit(alpha))
    expected = [1.0, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.36 + 0.036 + 0.018]
    assert tau[0].tolist() == pytest.approx(expected)
    outputs = torch.randn(64, 5) * 3
    tau = policy.predicted_tau(outputs)
    torch.testing.assert_close(policy.consistent_tau(tau), tau)
    policy.save_pretrained(tmp_path / "p")
    assert "running products of one acceptance per draft slot" in (tmp_path / "p" / "README.md").read_text()
    loaded = BlockPilotPolicy.from_pretrained(tmp_path / "p")
    assert loaded.tau_head == "per_slot"
    features = torch.randn(2, 2 * 2 * HIDDEN + NUM_SCALAR_FEATURES)
    torch.testing.assert_close(loaded.predicted_tau(loaded(features)), policy.predicted_tau(policy(features)))
    with pytest.raises(ValueError, match="needs objective 'tau'"):
        make_policy(target, objective="throughput", tau_head="per_slot")
    with pytest.raises(ValueError, match="tau_head must be one of"):
        make_policy(target, objective="tau", tau_head="per_token")
