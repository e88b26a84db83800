"""Scaled dot-product attention with grouped key/value heads, without repeating the keys and values."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for query (batch, heads, q, d) over key/value (batch, kv_heads, k, d)
    with `heads` a multiple of `kv_heads` (no causal mask; `attention_mask` (batch | 1, 1, q, k) is shared by
    the heads). Returns (batch, heads, q, d_v).

    The query heads that share a key/value head are stacked as extra query rows, (batch, kv_heads, groups * q,
    d), and the mask is repeated for them: the keys and values are used as they are, where repeating them per
    head copies the whole context in every layer (and, with a mask, sends PyTorch to its math kernel on CPU).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups > 1:
        query = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # head h uses kv head h // groups
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(2).expand(-1, -1, groups, -1, -1)
            attention_mask = mask.reshape(attention_mask.shape[0], 1, groups * q_len, attention_mask.shape[-1])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    return out.reshape(batch, heads, q_len, value.shape[-1])


def draft_attention_mask(
    q_len: int, k_len: int, is_causal: bool, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The DFlash reference's boolean mask (1, 1, q_len, k_len), True = attend, for the last `q_len` of `k_len`
    contiguous keys as queries (`draft_visibility`). `None` when every key is visible. Built on `device`."""
    if not is_causal and sliding_window is None:
        return None
    keys = torch.arange(k_len, device=device)[None]
    return draft_visibility(keys[:, k_len - q_len :], keys, is_causal, sliding_window)


def draft_visibility(
    query_positions: torch.Tensor, key_positions: torch.Tensor, is_causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """(batch, 1, q, k) True where a query at `query_positions` (batch, q) sees a key at `key_positions` (batch, k):
    causal, no later key; with a window W, no key W or more tokens before it (and, not causal, none W or more
    after it)."""
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # how far each key lies before the query
    visible = distance >= 0 if is_causal else torch.ones_like(distance, dtype=torch.bool)
    if sliding_window is not None:
        visible &= distance < sliding_window
        if not is_causal:
            visible &= distance > -sliding_window
    return visible[:, None]
