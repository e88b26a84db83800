"""DFlash 2 drafters (grouped dynamic causal convolutions + a candidate selector): checkpoints built and saved by
the authors' reference classes (PyPI `dflash==0.1.0`) load unchanged, draft what the reference drafts round for
round, sample exactly (χ² with a negative control), save in the same layout and work under the controllers."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from conftest import greedy_generate, init_dflash2, make_dflash2_drafter, make_sharp_target, make_target
from test_reference_parity import (
    _target,
    assert_rounds_equal_the_reference,
    reference_config,
)
from test_sampling import (
    CONFIGS,
    PROMPT,
    ArgmaxDraftsDecoder,
    chi2_critical,
    chi_square,
    draw,
    exact_joint,
)

import hf_blockpilot.custom_generate as custom_generate_module
from hf_blockpilot import AdaptiveVerify, BlockDiffusionDrafter, BlockPilotPolicy
from hf_blockpilot.costs import CostModel
from hf_blockpilot.modeling_block_diffusion import DraftContextCache

reference = pytest.importorskip("dflash.model", reason="the reference package: pip install --no-deps dflash==0.1.0")

VOCAB, HIDDEN = 24, 64
SIZES = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def reference_dflash2(target, directory, num_layers=2, block_size=4, layer_ids=(0, 2), seed=0, sharpen=6.0, **sizes):
    """A random DFlash 2 drafter built and saved by the reference's `DFlash2DraftModel`."""
    config = reference_config(target, num_layers, block_size, layer_ids, "DFlash2DraftModel", **{**SIZES, **sizes})
    torch.manual_seed(seed)
    model = reference.DFlash2DraftModel(config).eval()
    init_dflash2(model, seed, sharpen)
    model.save_pretrained(directory)
    return model


def _block(drafter, anchor: int, width: int) -> torch.Tensor:
    block = torch.full((1, width), drafter.mask_token_id)
    block[0, 0] = anchor
    return block


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dflash2_hidden_states_and_selection_equal_the_reference(tmp_path, family):
    target = _target(family, seed=0).double()
    ref = reference_dflash2(target, tmp_path / "d")
    ref = reference.DFlash2DraftModel.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    assert ours.config.is_dflash2 and ours.candidate_selector.top_k == 5
    ids = torch.randint(1, VOCAB - 1, (1, 14), generator=torch.Generator().manual_seed(1))
    head = target.lm_head
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in ours.target_layer_ids], dim=-1)
        embed = target.get_input_embeddings()
        ref_cache, our_cache = reference._make_cache(ref.config), DraftContextCache()
        for start, stop in ((0, 9), (9, 13)):  # a fresh context, then one more round on the cached one
            block = _block(ours, int(ids[0, stop]), 4)
            positions = torch.arange(start, stop + 4)[None]
            expected = ref(
                target_hidden=context[:, start:stop],
                noise_embedding=embed(block),
                position_ids=positions,
                past_key_values=ref_cache,
                use_cache=True,
            )[:, -3:]
            reference._crop_to(ref_cache, stop)
            got = ours(
                block_embeds=embed(block),
                block_position_ids=positions[:, -4:],
                target_hidden=context[:, start:stop],
                context_position_ids=positions[:, :-4],
                cache=our_cache,
            ).last_hidden_state[:, 1:]
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
            logits = ours.finish_logits(head(got))
            score = ours.candidate_selector.scorer(got, logits)
            for temperature in (0.0, 0.7):
                torch.manual_seed(start)
                path, candidates, q = ref.propose(expected, block[:, 0], head, temperature)
                previous = block[:, 0]
                for i in range(3):
                    scores = score(i, previous)
                    assert set(scores.isfinite().nonzero()[:, 1].tolist()) == set(candidates[0, i].tolist())
                    if temperature == 0:
                        assert int(scores.argmax()) == int(path[0, i])
                    else:  # the selector's sampling distribution over its candidates, given the path drawn
                        mine = torch.softmax(scores / temperature, -1)[0, candidates[0, i]]
                        torch.testing.assert_close(mine.to(q.dtype), q[0, i])  # the reference: float32 q
                    previous = path[:, i]


def test_dflash2_rounds_equal_the_reference_loop(tmp_path, monkeypatch):
    """>= 20 randomized greedy cases: rounds equal `dflash_generate`'s, output equals plain `generate`."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    full = partial = 0
    targets = {(family, seed): _target(family, seed).double() for family in ("qwen3", "llama") for seed in (0, 1)}
    for case in range(24):
        rng = random.Random(case)
        target = targets[rng.choice(sorted(targets))]
        block_size = rng.choice([2, 3, 4, 6, 8])
        directory = tmp_path / f"d{case}"
        reference_dflash2(
            target,
            directory,
            num_layers=rng.choice([1, 2]),
            block_size=block_size,
            layer_ids=rng.choice([(1,), (0, 2), (1, 2, 3)]),
            seed=case,
            sharpen=rng.choice([4.0, 8.0]),
            # the reference fails on blocks shorter than kernel_size - 1 (its shift loses the padding),
            # which its own last rounds produce for kernels > 3: ours pads them with zeros
            conv_kernel_size=rng.choice([2, 3]),
            conv_group_size=rng.choice([8, 16, 32]),
            selector_top_k=rng.choice([2, 5, 12]),
        )
        ref = reference.DFlash2DraftModel.from_pretrained(directory, dtype=torch.float64).eval()
        ours = BlockDiffusionDrafter.from_pretrained(directory, dtype=torch.float64).eval()
        counts = assert_rounds_equal_the_reference(ref, ours, target, rng, case)
        full, partial = full + counts[0], partial + counts[1]
    assert full >= 5 and partial >= 5, (full, partial)


def test_dflash2_saves_in_the_layout_the_reference_loads(tmp_path):
    target = _target("qwen3", seed=0)
    reference_dflash2(target, tmp_path / "ref")
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "ref").eval()
    ours.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in SIZES} == SIZES
    back = reference.DFlash2DraftModel.from_pretrained(tmp_path / "ours").eval()
    ours_state = ours.state_dict()
    assert set(back.state_dict()) == set(ours_state)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ours_state[name]), name
    # released checkpoints may store the codebooks as bare tensors: they load all the same
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "ours" / "model.safetensors")
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}"] = weights.pop(f"candidate_selector.{name}.weight")
    save_file(weights, tmp_path / "ours" / "model.safetensors", metadata={"format": "pt"})
    bare = BlockDiffusionDrafter.from_pretrained(tmp_path / "ours")
    assert torch.equal(
        bare.candidate_selector.successor_codebook.weight, ours.candidate_selector.successor_codebook.weight
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["dflash_config"].pop("selector_rank"), "missing ['selector_rank']"),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), "inconsistent"),
        (lambda c: c["dflash_config"].update(conv_group_size=7), "must divide hidden_size"),
        (lambda c: c.update(draft_vocab_size=8), "drop draft_vocab_size"),
    ],
)
def test_broken_dflash2_configs_are_clear_errors(tmp_path, edit, message):
    reference_dflash2(_target("qwen3", seed=0), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "d")


def test_dflash2_works_under_the_policy_and_the_adaptive_controller(tmp_path):
    from test_policy import make_policy

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.pad_token_id = 0
    reference_dflash2(target, tmp_path / "d", layer_ids=(1, 3), seed=2)
    drafter = BlockDiffusionDrafter.from_pretrained(tmp_path / "d").eval()
    policy = make_policy(target, drafter, candidates=(3, 6))
    cost = CostModel(target_ms={1: 10.0, 16: 14.0}, drafter_ms={16: 1.0})
    verified = {"PrefillMLPPolicy": 0, "AdaptiveVerify": 0}
    for seed in range(4):
        prompt = torch.randint(1, 47, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        plain = greedy_generate(target, prompt, 20, None)
        for controller in (policy, AdaptiveVerify(6, cost_model=cost), AdaptiveVerify(policy=policy, cost_model=cost)):
            if isinstance(controller, BlockPilotPolicy):
                drafter.set_policy(controller)
                got = greedy_generate(target, prompt, 20, None, assistant_model=drafter)
                drafter.set_policy(None)
            else:
                got = greedy_generate(target, prompt, 20, None, assistant_model=drafter, draft_controller=controller)
            assert torch.equal(got, plain), (seed, controller)
            assert drafter.last_stats.drafter_forwards > 0  # the selector ran (the controller may verify none)
            verified[type(controller).__name__] += sum(drafter.last_stats.drafted_per_round)
    assert verified["PrefillMLPPolicy"] > 0


# ----------------------------------------------------------------------------------------- exact sampling
SAMPLING_VOCAB = 4


@pytest.fixture(scope="module")
def sampling_target():
    return make_sharp_target(SAMPLING_VOCAB)


def _sampling_drafter(target) -> BlockDiffusionDrafter:
    """A DFlash 2 drafter over 3 of the 4 tokens per slot, whose selector's pair scores move its choice."""
    drafter = make_dflash2_drafter(target, seed=3, block_size=4, selector_top_k=3)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.weight.mul_(3.0)
    return drafter


@pytest.mark.parametrize("config", ["t1_no_processors", "t09_topp_minp"])
def test_dflash2_sampling_matches_the_exact_distribution(sampling_target, built_decoders, config):
    """The selector's candidates are warped by generate's processors like any draft logits, and drafts are drawn
    from exactly what is handed to the verifier."""
    drafter = _sampling_drafter(sampling_target)
    counts, drafted, accepted, _ = draw(sampling_target, drafter, 5000, **CONFIGS[config])
    assert len(built_decoders) > 0
    assert 0.1 * 5000 < accepted < drafted
    stat, df = chi_square(counts, exact_joint(sampling_target, PROMPT, **CONFIGS[config]))
    print(
        f"dflash2 {config}: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f} drafted={drafted} accepted={accepted}"
    )
    assert df >= 10 and stat < chi2_critical(df)


def test_dflash2_chi_square_rejects_a_broken_generator(sampling_target, monkeypatch, built_decoders):
    monkeypatch.setattr(custom_generate_module, "BatchedSpeculativeDecoder", ArgmaxDraftsDecoder)
    drafter = _sampling_drafter(sampling_target)
    counts, _, accepted, _ = draw(sampling_target, drafter, 2000, temperature=1.0, top_k=None)
    assert isinstance(built_decoders[-1], ArgmaxDraftsDecoder) and accepted > 0
    stat, df = chi_square(counts, exact_joint(sampling_target, PROMPT, temperature=1.0, top_k=None))
    assert stat > chi2_critical(df), f"broken generator passed: chi2={stat:.1f} df={df}"


def test_dflash2_weights_under_the_v1_name_are_an_error_naming_them(tmp_path):
    """Without its sizes in the config, a DFlash 2 checkpoint would load as a v1 drafter that ignores its
    convolutions and selector: an error naming the weights instead."""
    reference_dflash2(_target("qwen3", seed=0), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["DFlashDraftModel"]
    for name in SIZES:
        config["dflash_config"].pop(name)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weights this drafter does not use .*attention_conv"):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "d")
