"""The one-query attention kernel (bfloat16 and float32): used only where it probes bit-equal to PyTorch's SDPA (a
simulated kernel that rounds otherwise must be caught, on any CPU), and where it is used, plain `generate`'s greedy
output stays."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter

from hf_blockpilot import attention_kernel, exact_verify
from hf_blockpilot.controllers import DraftController


def _sdpa(query, key, value, scale, parts):
    return attention_kernel._one_query_calls(query, key, value, scale)


def _one_ulp_up_at(keys: int):
    """SDPA, but one output one step up (in its dtype) wherever the call has `keys` keys."""

    def kernel(query, key, value, scale, parts):
        out = _sdpa(query, key, value, scale, parts)
        if key.shape[2] == keys:
            out = out.clone()
            out.view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32)[0, 0, 0, 0] += 1
        return out

    return kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_takes_a_kernel_only_where_it_gives_sdpas_bits(dtype):
    assert attention_kernel.probe_parts(_sdpa, 9, 3, 64, dtype) == attention_kernel.PARTS[0]
    for keys in (attention_kernel.PROBE_KEYS[-1], attention_kernel.ADVERSARIAL_KEYS[-1]):
        assert attention_kernel.probe_parts(_one_ulp_up_at(keys), 9, 3, 64, dtype) is None, keys

    def right_with_two_parts(query, key, value, scale, parts):
        wrong = _one_ulp_up_at(key.shape[2])
        return (_sdpa if parts == 2 else wrong)(query, key, value, scale, parts)

    assert attention_kernel.probe_parts(right_with_two_parts, 4, 2, 16, dtype) == 2


def test_the_adversarial_values_show_the_summation_order():
    """With q = 0 every key weighs alike: SDPA's output is the column sums over the keys, and the probe's values make
    that sum depend on the order (+2^24 and -2^24 around a 1), so a kernel summing in another order differs."""
    generator = torch.Generator().manual_seed(0)
    blocks = list(attention_kernel.adversarial_values(22, 16, generator))
    assert len(blocks) == 8  # 22 * 21 pairs, sampled down to `limit` blocks of 16 columns
    v = blocks[0].float()
    assert (v == 2.0**24).sum(0).eq(1).all() and (v == -(2.0**24)).sum(0).eq(1).all() and (v == 1).sum(0).eq(1).all()
    forward, backward = torch.zeros(16), torch.zeros(16)
    for first, last in zip(v, v.flip(0), strict=True):  # float32 sums key by key, in key order and in reverse
        forward, backward = forward + first, backward + last
    assert not torch.equal(forward, backward)  # the order shows


def test_the_kernel_serves_only_one_rows_unmasked_bfloat16_or_float32_queries():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    assert attention_kernel.one_query_calls(*(t.double() for t in (q, k, v)), None) is None  # float64
    assert attention_kernel.one_query_calls(q, k.bfloat16(), v.bfloat16(), None) is None  # mixed dtypes
    bf = [t.bfloat16() for t in (q, k, v)]
    assert attention_kernel.one_query_calls(*(t.expand(2, -1, -1, -1) for t in bf), None) is None  # two rows
    assert attention_kernel.one_query_calls(bf[0].expand(1, 4, 11, 16), *bf[1:], None) is None  # more than the keys
    long = torch.zeros(1, 2, attention_kernel.MAX_KEYS + 1, 16).bfloat16()
    assert attention_kernel.one_query_calls(bf[0], long, long, None) is None


def test_the_kernel_is_switched_off_by_its_environment_variable(monkeypatch):
    monkeypatch.setenv(attention_kernel.SWITCH, "0")
    monkeypatch.setattr(attention_kernel, "_exact_parts", {})
    attention_kernel.extension.cache_clear()
    try:
        assert attention_kernel.extension() is None
        q, k = torch.randn(1, 4, 1, 64).bfloat16(), torch.randn(1, 2, 10, 64).bfloat16()
        assert attention_kernel.one_query_calls(q, k, k, None) is None
    finally:
        attention_kernel.extension.cache_clear()


def _exact_here(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
    parts = attention_kernel.exact_parts(heads, kv_heads, head_dim, dtype)
    if parts is None:
        pytest.skip("no exact one-query attention kernel on this CPU (not AVX-512, not built, or not bit-equal)")
    return parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_sdpas_bits_over_slices_of_a_cache(threads, dtype):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _exact_here(9, 3, 64, dtype)
        generator = torch.Generator().manual_seed(threads)
        cache = torch.randn(2, 1, 3, 520, 64, generator=generator).to(dtype)  # keys and values, room to spare
        for keys in (1, 2, 3, 4, 7, 15, 16, 33, 100, 257, 511, 512):  # float32: 1-3 keys past a group of four
            for scale in (0.5, 4.0):  # peaky weights: the exponentials' sum order shows
                for queries in {1, min(keys, 5)}:  # a step; a verify's slots, each over the keys up to it
                    q = (scale * torch.randn(1, 9, queries, 64, generator=generator)).to(dtype)
                    k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]
                    expected = attention_kernel._one_query_calls(q, k, v, 0.125)
                    got = attention_kernel.one_query_calls(q, k, v, 0.125)
                    assert torch.equal(got, expected), (keys, scale, queries)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_output_stays_plain_generates_where_steps_and_slots_take_the_kernel(monkeypatch, dtype):
    """A model with head dim 64 (the kernel's layout probed exact in its dtype): its one-token steps and verify slots
    go through the kernel, and speculative greedy output equals plain `generate`'s token for token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    target = LlamaForCausalLM(config).eval().to(dtype)
    _exact_here(4, 2, 64, dtype)
    drafter = make_drafter(target, block_size=4, seed=3, scale=4.0).to(dtype)
    served = []
    real = exact_verify.one_query_calls

    def counting(query, key, value, scale):
        out = real(query, key, value, scale)
        served.append(out is not None)
        return out

    monkeypatch.setattr(exact_verify, "one_query_calls", counting)
    for case in range(3):
        prompt = torch.randint(3, 64, (1, 6 + 7 * case), generator=torch.Generator().manual_seed(case))
        kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
        plain = target.generate(prompt, **kwargs)
        out = target.generate(prompt, assistant_model=drafter, draft_controller=DraftController(4), **kwargs)
        assert torch.equal(out, plain), case
    assert served and all(served)  # every step and every verify took the kernel
