"""`grouped_sdpa` equals attention over repeated key/value heads; the drafter's context cache keeps incremental
drafting equal to one uncached forward, and writes rounds in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target, make_windowed_drafter

from hf_blockpilot.attention import grouped_sdpa
from hf_blockpilot.modeling_block_diffusion import DraftContextCache, StaticDraftContextCache


@pytest.mark.parametrize("kv_heads,groups", [(2, 1), (2, 2), (3, 3)])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_sdpa_matches_sdpa_over_repeated_heads(kv_heads, groups, q_len, masked):
    gen = torch.Generator().manual_seed(kv_heads * 10 + groups + q_len)
    batch, keys, dim = 2, 11, 8
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=gen)
    key, value = (
        torch.randn(batch, kv_heads, keys, dim, generator=gen),
        torch.randn(batch, kv_heads, keys, dim, generator=gen),
    )
    mask = torch.rand(batch, 1, q_len, keys, generator=gen) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees at least one key
    expected = F.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(grouped_sdpa(query, key, value, mask, scale=0.3), expected, rtol=1e-5, atol=1e-6)


def _block(hidden, start, size, seed):
    """Embeddings and positions of a block anchored at `start`."""
    return torch.randn(1, size, hidden, generator=torch.Generator().manual_seed(seed)), torch.arange(
        start, start + size
    )[None]


def _cached_round_equals_uncached(drafter, context, cache, seen: int, new: int, seed: int) -> None:
    """Draft a block after `new` more context tokens on `cache`: equal to one uncached forward over all of it."""
    embeds, positions = _block(64, seen + new, 4, seed)
    cached = drafter(
        block_embeds=embeds,
        block_position_ids=positions,
        target_hidden=context[:, seen : seen + new],
        context_position_ids=torch.arange(seen, seen + new)[None],
        cache=cache,
    ).last_hidden_state
    assert cache.get_seq_length() == seen + new  # the block itself is never kept
    uncached = drafter(
        block_embeds=embeds,
        block_position_ids=positions,
        target_hidden=context[:, : seen + new],
        context_position_ids=torch.arange(seen + new)[None],
    ).last_hidden_state
    torch.testing.assert_close(cached, uncached, rtol=1e-5, atol=1e-5)


def test_cached_rounds_equal_one_uncached_forward_and_reuse_storage():
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = make_drafter(target, block_size=4, num_hidden_layers=2)
    width = len(drafter.target_layer_ids) * 64
    context = torch.randn(1, 90, width, generator=torch.Generator().manual_seed(1))
    cache, seen, pointers = DraftContextCache(), 0, set()
    with torch.no_grad():
        for round_, new in enumerate((7, 1, 3, 2, 60, 17)):  # growth past the first capacity, then in place
            _cached_round_equals_uncached(drafter, context, cache, seen, new, round_)
            seen += new
            if round_ >= 4:
                pointers.add(cache._keys[0].data_ptr())
    assert len(pointers) == 1  # rounds within capacity write in place (no copy of the context)


@pytest.mark.parametrize(
    ("layer_types", "is_causal"), [(["sliding_attention", "full_attention"], None), (["sliding_attention"] * 2, False)]
)
def test_sliding_window_layers_drop_the_context_out_of_reach(layer_types, is_causal):
    """A sliding-window layer's cache drops the context its window no longer reaches, also in rounds that only
    take in context (prompt lookup's): rounds still equal one uncached forward, its storage stays bounded."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = make_windowed_drafter(target, 3, layer_types, is_causal, block_size=4, num_hidden_layers=2)
    width = len(drafter.target_layer_ids) * 64
    context = torch.randn(1, 300, width, generator=torch.Generator().manual_seed(1))
    cache, seen = DraftContextCache(), 0
    with torch.no_grad():
        # (new context tokens, whether a block is drafted): blocks after 0 or 1 new tokens reach into the cache,
        # also right after it dropped tokens (the first block overflows the 64 slots the first round filled)
        rounds = [(64, False), (0, True), (30, True), *[(3, False), (0, True), (1, True), (2, False)] * 30, (26, True)]
        for round_, (new, drafts) in enumerate(rounds):
            if drafts:
                _cached_round_equals_uncached(drafter, context, cache, seen, new, round_)
            else:
                drafter.extend_context(context[:, seen : seen + new], torch.arange(seen, seen + new)[None], cache)
            seen += new
    assert cache.get_seq_length() == seen == 300
    storage = [keys.shape[-2] for keys in cache._keys]
    assert storage[0] <= 128, storage  # the sliding layer: its window's reach, new tokens and room to spare
    assert storage[1] >= seen if layer_types[1] == "full_attention" else storage[1] <= 128


@pytest.mark.parametrize(
    ("layer_types", "is_causal", "compiled"),
    [
        (None, None, True),
        (["sliding_attention", "full_attention"], None, False),
        (["sliding_attention"] * 2, True, False),
    ],
)
def test_static_cache_rounds_equal_one_uncached_forward(layer_types, is_causal, compiled):
    """`compile=True`'s drafter cache (each context token at its position's slot, the whole storage masked): every
    round, eager or compiled, drafts as one uncached forward over the context; entries not kept (a batch row's
    rejected drafts) go to the sink slot unseen, and the next round writes those positions for real."""
    from transformers import CompileConfig

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    kwargs = dict(block_size=4, num_hidden_layers=2)
    drafter = (
        make_drafter(target, **kwargs)
        if layer_types is None
        else make_windowed_drafter(target, 3, layer_types, is_causal, **kwargs)
    )
    forward = drafter.compiled_forward(CompileConfig(fullgraph=True)) if compiled else drafter
    width = len(drafter.target_layer_ids) * 64
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(1, 60, width, generator=gen)
    cache, seen = StaticDraftContextCache(1, 64, torch.device("cpu")), 0
    with torch.no_grad():
        for round_, new in enumerate((9, 1, 3, 2, 1, 4)):
            rejected = 2 if round_ % 2 else 0  # states of drafts the round did not keep, past its new context
            hidden = torch.cat([context[:, seen : seen + new], torch.randn(1, rejected, width, generator=gen)], 1)
            positions = torch.arange(seen, seen + new + rejected)[None]
            valid = positions < seen + new
            cache.place(positions, valid)
            drafter.extend_context(hidden, positions.masked_fill(~valid, 0), cache)
            embeds, block_positions = _block(64, seen + new, 4, round_)
            static = forward(
                block_embeds=embeds,
                block_position_ids=block_positions,
                target_hidden=hidden[:, :0],
                context_position_ids=positions[:, :0],
                cache=cache,
            ).last_hidden_state
            uncached = drafter(
                block_embeds=embeds,
                block_position_ids=block_positions,
                target_hidden=context[:, : seen + new],
                context_position_ids=torch.arange(seen + new)[None],
            ).last_hidden_state
            torch.testing.assert_close(static, uncached, rtol=1e-5, atol=1e-5)
            seen += new
    assert cache._keys[0].shape[-2] == 64 and int(cache.filled.sum()) == seen  # storage allocated once
