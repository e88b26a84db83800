"""Mismatched drafters fail early with a ValueError naming the mismatch; other assistants stay on stock paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import LlamaForCausalLM
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator

from hf_blockpilot import BlockDiffusionConfig, BlockDiffusionDrafter

VOCAB, HIDDEN, LAYERS = 97, 64, 4


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0, **kwargs)


def _prompt(batch: int = 1):
    return torch.randint(3, VOCAB, (batch, 6), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)


def _config(**overrides) -> BlockDiffusionConfig:
    """A drafter config sized for `target` (overrides make it mismatch)."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=4,
        num_target_layers=LAYERS,
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2]},
    )
    kwargs.update(overrides)
    return BlockDiffusionConfig(**kwargs)


def _drafter(**overrides) -> BlockDiffusionDrafter:
    torch.manual_seed(0)
    return BlockDiffusionDrafter(_config(**overrides)).eval()


def test_matching_drafter_is_accepted(target):
    """Control: the config used below, unmodified, serves the target."""
    drafter = _drafter()
    drafter.check_compatible(target)
    assert torch.equal(_greedy(target, _prompt(), assistant_model=drafter), _greedy(target, _prompt()))


def test_hidden_size_mismatch(target):
    other = make_target("qwen3", vocab_size=VOCAB, hidden_size=32, layers=LAYERS, seed=1)
    drafter = make_drafter(other)
    with pytest.raises(ValueError, match=r"hidden_size=32 but target .* hidden_size=64.*built for another target"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_num_target_layers_mismatch(target):
    drafter = make_drafter(make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=6, seed=1))
    with pytest.raises(ValueError, match=r"built for a target with 6 layers but .* has 4"):
        _greedy(target, _prompt(), assistant_model=drafter)


@pytest.mark.parametrize("bad_ids", [[1, 4], [-1, 2], [9]])
def test_target_layer_ids_out_of_range(target, bad_ids):
    with pytest.raises(ValueError, match=r"target_layer_ids .* out of range for a target with 4 layers"):
        BlockDiffusionDrafter.from_target(target, target_layer_ids=bad_ids)
    drafter = _drafter(dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": bad_ids})
    with pytest.raises(ValueError, match=r"target_layer_ids .* out of range .*\(valid: 0\.\.3\)"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_vocab_size_mismatch(target):
    drafter = _drafter(vocab_size=48, dflash_config={"mask_token_id": 47, "target_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=r"vocab_size=48 but target .* 97 embedding rows: wrong vocabulary"):
        drafter.check_compatible(target)
    # generate() refuses it too (today Transformers' own assistant validation fires first, see below)
    with pytest.raises(ValueError, match=r"vocab_size=48|different tokenizers"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_vocab_size_mismatch_message_from_generate(target):
    drafter = _drafter(vocab_size=48, dflash_config={"mask_token_id": 47, "target_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=r"vocab_size=48"):
        _greedy(target, _prompt(), assistant_model=drafter)


@pytest.mark.parametrize("mask_id", [VOCAB, 1000, -1])
def test_mask_token_outside_embedding_table(target, mask_id):
    with pytest.raises(ValueError, match=rf"mask_token_id={mask_id} is not a row of the target's embedding table"):
        BlockDiffusionDrafter.from_target(target, mask_token_id=mask_id)
    drafter = _drafter(dflash_config={"mask_token_id": mask_id, "target_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=rf"mask_token_id={mask_id} is not a row .*0\.\.96"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_missing_mask_token(target):
    drafter = _drafter(dflash_config={"target_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=r"mask_token_id=None is not a row"):
        _greedy(target, _prompt(), assistant_model=drafter)


def test_batch_size_two_runs_the_batched_loop(target):
    prompt = _prompt(batch=2)
    assert torch.equal(_greedy(target, prompt, assistant_model=make_drafter(target)), _greedy(target, prompt))


@pytest.mark.parametrize("value", [1, 0, -4, 2.5, 3.0, "4", True, None, 257, 10_000])
def test_block_size_setter_rejects(target, value):
    drafter = make_drafter(target, block_size=8)
    with pytest.raises(ValueError, match=r"block_size must be an int in 2\.\.256"):
        drafter.block_size = value
    assert drafter.block_size == 8  # unchanged
    drafter.block_size = 2
    assert drafter.block_size == 2


@pytest.mark.parametrize("value", [1, 0, -4, 2.5, 3.0, "4", True, None])
def test_block_size_config_rejects(value):
    with pytest.raises(ValueError, match=r"block_size must be"):
        _config(block_size=value)


@pytest.mark.parametrize("value", [1, 2.5])
def test_block_size_from_target_rejects(target, value):
    with pytest.raises(ValueError, match=r"block_size must be"):
        BlockDiffusionDrafter.from_target(target, block_size=value)


def test_stock_assistant_goes_through_stock_transformers(target, built_decoders, monkeypatch):
    built_generators = []
    stock_candidates = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        built_generators.append(stock_candidates(self, *args, **kwargs))
        return built_generators[-1]

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    assistant = make_target("qwen3", vocab_size=VOCAB, hidden_size=32, layers=1, seed=5)
    llama_assistant = make_target("llama", vocab_size=VOCAB, hidden_size=32, layers=1, seed=6)
    assert isinstance(llama_assistant, LlamaForCausalLM)
    prompt = _prompt()
    expected = _greedy(target, prompt)
    for stock in (llama_assistant, assistant):
        stock.generation_config.pad_token_id = 0
        got = _greedy(target, prompt, assistant_model=stock)
        assert type(built_generators[-1]) is AssistedCandidateGenerator
        assert torch.equal(got, expected)

    got = _greedy(target, prompt, prompt_lookup_num_tokens=3)
    assert type(built_generators[-1]) is PromptLookupCandidateGenerator
    assert torch.equal(got, expected)

    # and the drafter is routed to ours
    drafter = make_drafter(target)
    assert torch.equal(_greedy(target, prompt, assistant_model=drafter), expected)
    assert len(built_decoders) == 1 and len(built_generators) == 3  # ours builds no candidate generator
    assert drafter.last_stats is not None and drafter.last_stats.drafter_forwards > 0


def test_beam_search_with_a_drafter_is_a_clear_error(target):
    """Stock Transformers would run beam search and silently ignore the assistant when num_beams > 1."""
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=r"beam search \(num_beams > 1"):
        target.generate(
            _prompt(), assistant_model=drafter, num_beams=2, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert drafter.last_stats is None


def test_rounds_never_draft_past_the_tokens_still_allowed(target):
    """A wide block near max_length drafts only the room left (the reference shortens its last block too)."""
    drafter = make_drafter(target, block_size=8)
    prompt = _prompt()
    for max_new in (1, 2, 4, 9):
        common = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
        expected = target.generate(prompt, **common)
        out = target.generate(prompt, **common, assistant_model=drafter, draft_controller=256)
        assert torch.equal(out, expected)
        stats = drafter.last_stats
        committed = 1  # the prefill's token
        for width, drafted, accepted in zip(
            stats.widths_per_round[1:], stats.drafted_per_round[1:], stats.accepted_per_round[1:]
        ):
            room = max_new - committed  # tokens still allowed
            assert width - 1 <= room and drafted <= room - 1, (max_new, stats.widths_per_round)
            committed += accepted + 1


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_pre_cached_prompt_is_an_error(target, name):
    """The drafter needs the target's hidden states of the whole prompt: a prompt passed with a filled cache
    would decode from a partial context (and differed from plain generate), so it is refused."""
    import inspect
    import warnings

    from transformers import DynamicCache

    if name == "cache" and name not in inspect.signature(target.forward).parameters:
        pytest.skip("this Transformers release names the cache `past_key_values` only")
    prompt = _prompt()
    cache = DynamicCache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        target(prompt[:, :4], **{name: cache})
        with pytest.raises(ValueError, match=r"cannot come pre-cached \(4 tokens"):
            _greedy(target, prompt, assistant_model=make_drafter(target), **{name: cache})


@pytest.mark.parametrize("temperature", [float("inf"), float("nan")])
def test_sampling_temperature_must_be_finite(target, temperature):
    with pytest.raises(ValueError, match="temperature"):  # NaN: Transformers' own check may answer first
        target.generate(
            _prompt(),
            do_sample=True,
            temperature=temperature,
            max_new_tokens=4,
            pad_token_id=0,
            assistant_model=make_drafter(target),
        )


def test_a_drafter_with_nan_weights_fails_sampling_with_a_clear_error(target):
    drafter = make_drafter(target)
    with torch.no_grad():
        drafter.fc.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="draft distribution is not finite"):
        target.generate(_prompt(), do_sample=True, max_new_tokens=8, pad_token_id=0, assistant_model=drafter)


def test_the_drafter_is_checked_against_the_target_once_per_call(target, monkeypatch):
    drafter = make_drafter(target, block_size=4)
    calls = []
    check = drafter.check_compatible
    monkeypatch.setattr(drafter, "check_compatible", lambda t: calls.append(t) or check(t))
    _greedy(target, _prompt(), assistant_model=drafter)
    assert calls == [target]
