"""The block-diffusion (DFlash) drafter.

One forward drafts a whole block: slot 0 holds the last accepted token, slots 1..b-1 a mask token. Every
draft layer attends over `[context ; block]`, where the context is the target's hidden states at
`target_layer_ids`, concatenated, projected by `fc` and normed by `hidden_norm`, and fed as extra keys/values to
every layer; without a mask (z-lab's drafters), or causal and/or within a sliding window, per layer, as the
config's `layer_types`, `sliding_window` and `is_causal` say. RoPE runs at absolute positions. The drafter owns
no embedding and no LM head: it borrows the target's.
"""

from __future__ import annotations

import contextvars
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import CompileConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ._compat import tensor_version
from .attention import draft_attention_mask, draft_visibility, grouped_sdpa
from .configuration_block_diffusion import BlockDiffusionConfig, build_target_layer_ids
from .controllers import check_block_size


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `x` of shape (batch, heads, seq, head_dim) with cos/sin of shape (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DraftContextCache:
    """Per-layer keys/values of the target context the drafter has already seen.

    Only context K/V is kept (each verified token's K/V is computed once); the block's own K/V is
    recomputed every draft and never stored. Storage grows geometrically and new entries are written in
    place, so a round copies only its new tokens, not the whole context. A sliding-window layer keeps only the
    context its window can still reach: when its storage is full, older tokens are dropped instead of growing it.
    """

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._lengths: list[int] = []  # tokens stored per layer
        self._dropped: list[int] = []  # tokens dropped per layer (out of its window), before the stored ones

    def get_seq_length(self) -> int:
        """Context tokens taken in so far (stored or dropped)."""
        return self._lengths[0] + self._dropped[0] if self._lengths else 0

    def update(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        block_key: torch.Tensor | None = None,
        block_value: torch.Tensor | None = None,
        keep: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new context K/V (batch, kv_heads, new, head_dim) for `layer_idx`; return the layer's context
        K/V followed by `block_key`/`block_value` if given (written after the context but not kept: the next
        update overwrites them). The results are views of the storage, valid until the next update.

        `keep`: later rounds need only the layer's last `keep` context tokens (a sliding window); older ones may
        be dropped, so the returned context is its latest tokens, at least `keep` of them where there are."""
        if layer_idx == len(self._keys):
            self._keys.append(key.new_empty(*key.shape[:-2], 0, key.shape[-1]))
            self._values.append(value.new_empty(*value.shape[:-2], 0, value.shape[-1]))
            self._lengths.append(0)
            self._dropped.append(0)
        start = self._lengths[layer_idx]
        added = key.shape[-2] + (0 if block_key is None else block_key.shape[-2])
        capacity = self._keys[layer_idx].shape[-2]
        if start + added > capacity:
            drop = 0 if keep is None else max(start - keep, 0)
            if drop:
                start = self._drop(layer_idx, drop)
            # after a drop, room for as much again as is in use: drops (each a copy of `keep` tokens) stay rare
            if start + added > capacity or (drop and 2 * (start + added) > capacity):
                capacity = max(start + added, 2 * capacity, 64)
                self._keys[layer_idx] = self._grow(self._keys[layer_idx], start, capacity)
                self._values[layer_idx] = self._grow(self._values[layer_idx], start, capacity)
        end = start + key.shape[-2]
        total = start + added
        self._keys[layer_idx][..., start:end, :] = key
        self._values[layer_idx][..., start:end, :] = value
        if block_key is not None:
            self._keys[layer_idx][..., end:total, :] = block_key
            self._values[layer_idx][..., end:total, :] = block_value
        self._lengths[layer_idx] = end
        return self._keys[layer_idx][..., :total, :], self._values[layer_idx][..., :total, :]

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keep only the batch rows `index` (a batch's finished rows leave it)."""
        self._keys = [stored.index_select(0, index) for stored in self._keys]
        self._values = [stored.index_select(0, index) for stored in self._values]

    def _drop(self, layer_idx: int, count: int) -> int:
        """Drop the layer's `count` oldest stored tokens (moving the rest to the front); return how many remain."""
        start = self._lengths[layer_idx]
        for stored in (self._keys[layer_idx], self._values[layer_idx]):
            stored[..., : start - count, :] = stored[..., count:start, :].clone()
        self._lengths[layer_idx] = start - count
        self._dropped[layer_idx] += count
        return start - count

    @staticmethod
    def _grow(stored: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        grown = stored.new_empty(*stored.shape[:-2], capacity, stored.shape[-1])
        grown[..., :length, :] = stored[..., :length, :]
        return grown


class StaticDraftContextCache:
    """Context K/V in storage allocated once, for a compiled drafter (`generate(..., compile=True)`): `capacity`
    slots a row, each context token at the slot of its position, and the last slot a sink for the entries no row
    keeps. Every forward sees the whole storage, masked where no context is written, so a block forward's shapes
    depend only on its width. `place` says where the next context goes."""

    def __init__(self, rows: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.filled = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.slot_positions = torch.arange(capacity, device=device)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.slots = torch.zeros(rows, 0, dtype=torch.long, device=device)

    def place(self, positions: torch.LongTensor, valid: torch.Tensor) -> None:
        """The next context's (rows, n) `positions`; entries not `valid` go to the sink slot and stay unseen."""
        self.slots = positions.masked_fill(~valid, self.capacity - 1)
        self.filled.scatter_(1, self.slots, valid)

    def update(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        block_key: torch.Tensor | None = None,
        block_value: torch.Tensor | None = None,
        keep: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DraftContextCache.update`, with the context written at the `place`d slots and the whole storage
        returned (then the block's K/V); `keep` is unused (`attention_mask` applies a window)."""
        if layer_idx == len(self._keys):
            shape = (*key.shape[:-2], self.capacity, key.shape[-1])
            self._keys.append(key.new_zeros(shape))
            self._values.append(value.new_zeros(shape))
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if key.shape[-2]:
            index = self.slots[:, None, :, None].expand_as(key)
            keys.scatter_(2, index, key)
            values.scatter_(2, index, value)
        if block_key is None:
            return keys, values
        return torch.cat([keys, block_key], dim=-2), torch.cat([values, block_value], dim=-2)

    def attention_mask(
        self, block_positions: torch.LongTensor, is_causal: bool, sliding_window: int | None
    ) -> torch.Tensor:
        """(rows, 1, width, capacity + width): what each slot of the block at `block_positions` (rows, width) sees
        of the written context and the block, under a layer's causal and window rules (`draft_visibility`)."""
        rows = self.filled.shape[0]
        keys = torch.cat([self.slot_positions.expand(rows, -1), block_positions], dim=1)
        written = torch.cat([self.filled, torch.ones_like(block_positions, dtype=torch.bool)], dim=1)
        return written[:, None, None, :] & draft_visibility(block_positions, keys, is_causal, sliding_window)

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keep only the batch rows `index` (a batch's finished rows leave it)."""
        self._keys = [stored.index_select(0, index) for stored in self._keys]
        self._values = [stored.index_select(0, index) for stored in self._values]
        self.filled = self.filled.index_select(0, index)


DraftCache = DraftContextCache | StaticDraftContextCache


class BlockDiffusionAttention(nn.Module):
    """Attention of block queries over [context ; block] keys/values (Qwen3 style, q/k norms): non-causal and
    unwindowed unless the config makes this layer causal or a sliding-window layer."""

    def __init__(self, config: BlockDiffusionConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.is_causal, self.sliding_window = config.layer_attention(layer_idx)
        #: context tokens later rounds can still attend to: a window's reach back from the block's first slot
        self.context_keep = None if self.sliding_window is None else self.sliding_window - 1

    def _keys_values(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq = x.shape[:2]
        key = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(key, *rotary), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        block_rotary: tuple[torch.Tensor, torch.Tensor],
        context_rotary: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        block_positions: torch.LongTensor | None = None,
    ) -> torch.Tensor:
        batch, q_len = hidden_states.shape[:2]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, self.num_heads, self.head_dim))
        query = apply_rotary(query.transpose(1, 2), *block_rotary)
        key_ctx, value_ctx = self._keys_values(context, context_rotary)
        key_blk, value_blk = self._keys_values(hidden_states, block_rotary)
        if cache is None:
            key, value = torch.cat([key_ctx, key_blk], dim=-2), torch.cat([value_ctx, value_blk], dim=-2)
        else:
            key, value = cache.update(self.layer_idx, key_ctx, value_ctx, key_blk, value_blk, keep=self.context_keep)
        if attention_mask is None and isinstance(cache, StaticDraftContextCache):
            attention_mask = cache.attention_mask(block_positions, self.is_causal, self.sliding_window)
        elif attention_mask is None:
            attention_mask = draft_attention_mask(
                q_len, key.shape[-2], self.is_causal, self.sliding_window, hidden_states.device
            )
        out = grouped_sdpa(query, key, value, attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash 2's convolution around a sublayer: causal over the block's slots, `kernel_size` taps per channel.

    Each tap's weight is a learned per-channel `base_kernel` plus a per-group weight predicted from the
    sublayer's input (`kernel_projection`), so `prepare` convolves the input before the sublayer and returns
    the predicted weights `finish` convolves its output with.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # (before, after) x taps
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def _convolve(
        self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int | None
    ) -> torch.Tensor:
        # out[t] = sum over taps o of (base[o] + dynamic[t, o] per group) * x[t - o], x before the block = 0;
        # a query of several blocks (training) is convolved block by block
        blocks = x if block_size is None else x.unflatten(1, (-1, block_size))
        per_channel = dynamic.repeat_interleave(self.group_size, dim=-1).view(*blocks.shape[:-1], -1, x.shape[-1])
        slots = blocks.shape[-2]
        out = torch.zeros_like(blocks)
        for tap in range(self.kernel_size):
            shifted = F.pad(blocks, (0, 0, tap, 0))[..., :slots, :]
            out = out + (base[tap].to(x.dtype) + per_channel[..., tap, :]) * shifted
        return out.view_as(x)

    def prepare(self, x: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The input convolved, and the predicted weights for `finish`; `block_size`: slots per block when `x`
        holds several blocks back to back (None: one block)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], block_size), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1], block_size)


class BlockDiffusionDecoderLayer(nn.Module):
    def __init__(self, config: BlockDiffusionConfig, layer_idx: int):
        super().__init__()
        self.self_attn = BlockDiffusionAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_dflash2:
            sizes = (
                config.hidden_size,
                config.dflash2_size("conv_kernel_size"),
                config.dflash2_size("conv_group_size"),
            )
            self.attention_conv, self.mlp_conv = GroupedDynamicCausalConv(*sizes), GroupedDynamicCausalConv(*sizes)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(
        self, hidden_states: torch.Tensor, context: torch.Tensor, block_size: int | None = None, **attn_kwargs
    ) -> torch.Tensor:
        hidden_states = hidden_states + self._around(
            self.attention_conv,
            lambda x: self.self_attn(x, context, **attn_kwargs),
            self.input_layernorm(hidden_states),
            block_size,
        )
        normed = self.post_attention_layernorm(hidden_states)
        return hidden_states + self._around(self.mlp_conv, self.mlp, normed, block_size)

    @staticmethod
    def _around(
        conv: GroupedDynamicCausalConv | None, sublayer, x: torch.Tensor, block_size: int | None
    ) -> torch.Tensor:
        if conv is None:
            return sublayer(x)
        x, dynamic = conv.prepare(x, block_size)
        return conv.finish(sublayer(x), dynamic, block_size)


class CandidateSelector(nn.Module):
    """DFlash 2's candidate selector: each slot's draft is one of its top-`top_k` tokens by draft logit, scored
    by that logit plus a low-rank pair score between the previous slot's token (predecessor codebook, scaled by
    the slot's projected hidden state) and the candidate (successor codebook); slots are chosen left to right."""

    def __init__(self, config: BlockDiffusionConfig):
        super().__init__()
        rank = config.dflash2_size("selector_rank")
        self.top_k = config.dflash2_size("selector_top_k")
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def scorer(self, hidden: torch.Tensor, logits: torch.Tensor):
        """For (1, k, hidden) slot states and their (1, k, V) draft logits: `score(i, previous)`, the (1, V)
        logits of slot i given the token drafted before it (previous: (1,) id), -inf outside its candidates."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        projected = self.project(hidden)

        def score(i: int, previous: torch.LongTensor) -> torch.Tensor:
            scores = unary[:, i] + self.pair_scores(projected[:, i], previous, candidates[:, i]).to(unary.dtype)
            return logits.new_full((1, logits.shape[-1]), float("-inf")).scatter(-1, candidates[:, i], scores)

        return score

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Slot states (..., hidden) projected to the pair score's rank."""
        return self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))

    def pair_scores(
        self, projected: torch.Tensor, previous: torch.LongTensor, candidates: torch.LongTensor
    ) -> torch.Tensor:
        """(..., top_k) pair scores of `candidates` (..., top_k) after the `previous` token (...,), for slots whose
        projected states are `projected` (..., rank); a candidate's score is its draft logit plus this."""
        pair = self.predecessor_codebook(previous) * projected
        return torch.einsum("...r,...kr->...k", pair, self.successor_codebook(candidates))


class BlockDiffusionPreTrainedModel(PreTrainedModel):
    config_class = BlockDiffusionConfig
    base_model_prefix = ""
    _no_split_modules = ["BlockDiffusionDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, Qwen3RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, GroupedDynamicCausalConv):  # starts as the identity: no mixing across slots
            module.base_kernel.zero_()
            module.base_kernel[:, 0] = 1.0
        elif isinstance(module, Qwen3RotaryEmbedding):
            # `inv_freq` is a non-persistent buffer: `from_pretrained` materialises it empty and relies on
            # `_init_weights` to recompute it (Transformers' base implementation does that).
            super()._init_weights(module)


#: Per thread (context): drafter -> the statistics of its latest `generate` call there (`last_stats`).
_last_stats: contextvars.ContextVar[weakref.WeakKeyDictionary | None] = contextvars.ContextVar(
    "hf_blockpilot_last_stats", default=None
)


class BlockDiffusionDrafter(BlockDiffusionPreTrainedModel):
    """DFlash block-diffusion drafter, used as `target.generate(..., assistant_model=drafter)`.

    Loads z-lab DFlash and DFlash 2 checkpoints unchanged (`from_pretrained("z-lab/Qwen3-4B-DFlash-b16")`) and
    saves in the same layout. `block_size` (settable, any int >= 2) is the block drafted per round when no policy is
    attached; `prompt_lookup` (settable, default off) lets rounds whose last tokens occurred earlier copy their
    continuation instead of drafting; `last_stats` holds the statistics of this thread's latest `generate` call
    with it (each call's own travel with its output: `output.speculation_stats`).
    """

    def __init__(self, config: BlockDiffusionConfig):
        super().__init__(config)
        num_context_layers = len(config.target_layer_ids)
        self.layers = nn.ModuleList(
            [BlockDiffusionDecoderLayer(config, idx) for idx in range(config.num_hidden_layers)]
        )
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(num_context_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) if config.is_dflash2 else None
        if config.draft_vocab_size is not None:
            # Draft-vocabulary index -> target token id (EAGLE-3's `d2t`, stored as absolute ids).
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self._block_size = config.block_size
        self._policy = None
        self._prompt_lookup = False
        self._head_cache: tuple[tuple | None, torch.Tensor, torch.Tensor | None] | None = None
        self.post_init()

    # ----------------------------------------------------------------------------------------- properties
    @property
    def last_stats(self) -> Any:
        """The statistics of this thread's latest `generate` call with this drafter (`None` before one): a
        convenience; another thread's calls never change it."""
        return (_last_stats.get() or {}).get(self)

    @last_stats.setter
    def last_stats(self, stats: Any) -> None:
        latest = weakref.WeakKeyDictionary(_last_stats.get() or {})
        latest[self] = stats
        _last_stats.set(latest)

    @property
    def block_size(self) -> int:
        """Block size drafted per round when no policy is attached (anchor slot included)."""
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block_size = check_block_size(value, "block_size")

    @property
    def prompt_lookup(self) -> bool:
        """Draft by prompt lookup (`hf_blockpilot.prompt_lookup`) in rounds where the last committed tokens
        occurred earlier, by the drafter otherwise. Lossless either way; off by default."""
        return self._prompt_lookup

    @prompt_lookup.setter
    def prompt_lookup(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"prompt_lookup must be True or False, got {value!r}")
        self._prompt_lookup = value

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def set_policy(self, policy: Any) -> None:
        """Attach a BlockPilot policy (object, Hub id or directory) choosing the block size per request; `None`
        detaches."""
        if isinstance(policy, (str, os.PathLike)):
            from .policy import BlockPilotPolicy

            policy = BlockPilotPolicy.from_pretrained(policy)
        if policy is not None:
            policy = policy.to(self.device).eval()
        # Kept out of `_modules`: the policy is a separate checkpoint, never part of the drafter's state dict.
        object.__setattr__(self, "_policy", policy)

    @property
    def policy(self) -> Any:
        """The attached BlockPilot policy, or `None` (then `block_size` is used for every request)."""
        return self._policy

    @classmethod
    def from_pretrained(cls, *args: Any, policy: Any = None, **kwargs: Any) -> BlockDiffusionDrafter:
        """`PreTrainedModel.from_pretrained`, plus `policy=` (Hub id, directory or object) to attach BlockPilot.

        A reduced-vocabulary checkpoint must carry its `d2t` map, with ids inside the vocabulary."""
        wants_info = kwargs.pop("output_loading_info", False)
        # DFlash 2 checkpoints may store the selector's codebooks as bare tensors (the reference maps them too)
        kwargs.setdefault(
            "key_mapping",
            {r"^candidate_selector\.(predecessor|successor)_codebook$": r"candidate_selector.\1_codebook.weight"},
        )
        drafter, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path", "the checkpoint")
        if drafter.d2t is not None and "d2t" in info.get("missing_keys", ()):
            raise ValueError(
                f"{source} declares a reduced draft vocabulary (draft_vocab_size={drafter.config.draft_vocab_size}) "
                "but its weights hold no `d2t` map (draft index -> target token id): the drafter would draft arbitrary "
                "ids. Re-save it with its map, or drop draft_vocab_size from its config.json if it drafts over the "
                "full vocabulary."
            )
        unknown = sorted(info.get("unexpected_keys", ()))
        absent = sorted(set(info.get("missing_keys", ())) - {"d2t"})
        problems = [f"weights this drafter does not use {unknown[:6]}"] * bool(unknown)
        problems += [f"weights it needs but the checkpoint lacks {absent[:6]}"] * bool(absent)
        if problems:
            raise ValueError(
                f"{source} does not match its config: {'; '.join(problems)} (a DFlash 2 checkpoint declares "
                "architectures=['DFlash2DraftModel'] and its sizes in dflash_config)"
            )
        drafter._check_draft_vocabulary(str(source))
        if policy is not None:
            drafter.set_policy(policy)
        return (drafter, info) if wants_info else drafter

    def _check_draft_vocabulary(self, source: str) -> None:
        """`d2t` ids must be distinct target token ids (0 <= id < vocab_size)."""
        if self.d2t is None:
            return
        ids = self.d2t.detach().cpu()
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.numel():
            raise ValueError(
                f"{source}: d2t maps draft tokens to ids {bad[:5].tolist()}, "
                f"outside the vocabulary 0..{self.config.vocab_size - 1}"
                ": the checkpoint's map is damaged or belongs to another vocabulary"
            )
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"{source}: d2t maps several draft tokens to one target id: the map is damaged")

    # ------------------------------------------------------------------------------------------- forward
    def embed_block(self, embeddings: nn.Module, block_ids: torch.LongTensor) -> torch.Tensor:
        """The block's input: rows of the target's raw embedding table times `input_embedding_scale`, as the
        reference implementation embeds them (a target's own embedding module may scale, e.g. Gemma's)."""
        weight = embeddings.weight
        embeds = F.embedding(block_ids.to(weight.device), weight)
        scale = self.config.input_embedding_scale
        return embeds if scale == 1.0 else embeds * scale

    def head_logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Float draft-vocabulary logits of drafted slots' `hidden` states through the target's head (`draft_head`'s
        `weight` / `bias`, which may sit on another device), finished (`finish_logits`)."""
        logits = F.linear(hidden.to(weight.device, weight.dtype), weight, bias)
        return self.finish_logits(logits.float())

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's `output_multiplier` and `final_logit_softcapping` applied to draft logits."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def full_vocabulary(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(..., V) logits over the target's `vocab_size` ids from (..., draft vocab) ones: ids outside a reduced
        draft vocabulary get -inf (probability 0); full-vocabulary logits are returned as they are."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        full[..., self.d2t.to(logits.device)] = logits
        return full

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(concat of target layers))`: the context fed to every draft layer."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def extend_context(
        self, target_hidden: torch.Tensor, context_position_ids: torch.LongTensor, cache: DraftCache
    ) -> None:
        """Append the context K/V of new target hidden states to `cache` without drafting a block (what a
        forward does to the cache, for rounds drafted otherwise)."""
        context = self.project_context(target_hidden)
        rotary = self.rotary_emb(context, context_position_ids)
        for layer in self.layers:
            attention = layer.self_attn
            cache.update(attention.layer_idx, *attention._keys_values(context, rotary), keep=attention.context_keep)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_position_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        context_position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        block_size: int | None = None,
    ) -> BaseModelOutput:
        """Run the drafter over one or more blocks.

        Args:
            block_embeds: (batch, n, hidden) target embeddings of the block tokens (anchor + masks).
            block_position_ids: (batch, n) absolute positions of the block tokens.
            target_hidden: (batch, c, len(target_layer_ids) * hidden) concatenated target hidden states of
                context tokens not yet in `cache`.
            context_position_ids: (batch, c) absolute positions of those context tokens.
            attention_mask: optional boolean (batch, 1, n, cached + c + n) mask, True = attend, used by every
                layer as it is (as the reference does). `None`: one block, each layer attending as the config
                says (all of the context and the block, unless causal or within a sliding window).
            cache: context K/V of earlier tokens, extended in place.
            block_size: slots per block where the query holds several blocks back to back (training), so that
                DFlash 2's convolutions stay within each block; `None`: the query is one block.

        Returns:
            `BaseModelOutput` whose `last_hidden_state` is the normed output at every block slot.
        """
        context = self.project_context(target_hidden)
        hidden_states = block_embeds.to(context.dtype)
        block_rotary = self.rotary_emb(hidden_states, block_position_ids)
        context_rotary = self.rotary_emb(hidden_states, context_position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context,
                block_rotary=block_rotary,
                context_rotary=context_rotary,
                block_positions=block_position_ids,
                attention_mask=attention_mask,
                cache=cache,
                block_size=block_size,
            )
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states))

    def compiled_forward(self, config: CompileConfig) -> Callable[..., BaseModelOutput]:
        """`forward` `torch.compile`d with `config`, once per config (as `PreTrainedModel.get_compiled_call`)."""
        if getattr(self, "_compiled_forward", (None,))[0] != config:
            self._compiled_forward = (config, torch.compile(self.forward, **config.to_dict()))
        return self._compiled_forward[1]

    def draft_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight (and bias) of the target LM head restricted to the draft vocabulary (all rows if full)."""
        weight = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        if self.d2t is None:
            return weight, bias
        # The row slice is a copy (19 MB for SmolLM2 at 8k rows): reuse it while head, map and mode are unchanged.
        versions = (tensor_version(weight), tensor_version(self.d2t))
        key = (*versions, torch.is_inference_mode_enabled()) if None not in versions else None
        if key is None or self._head_cache is None or self._head_cache[0] != key:
            d2t = self.d2t.to(weight.device)
            self._head_cache = (key, weight[d2t], None if bias is None else bias[d2t])
        return self._head_cache[1], self._head_cache[2]

    # ----------------------------------------------------------------------------------- compatibility
    def check_compatible(self, target: PreTrainedModel) -> None:
        """Raise a `ValueError` naming every mismatch if this drafter cannot serve `target`."""
        text_config = target.config.get_text_config()
        name = getattr(target.config, "_name_or_path", "") or type(target).__name__
        layers, rows = text_config.num_hidden_layers, target.get_input_embeddings().weight.shape[0]
        problems = []
        if self.config.hidden_size != text_config.hidden_size:
            problems.append(
                f"drafter hidden_size={self.config.hidden_size} but target {name} has hidden_size="
                f"{text_config.hidden_size}: the drafter was built for another target"
            )
        if self.config.num_target_layers is not None and self.config.num_target_layers != layers:
            problems.append(
                f"drafter was built for a target with {self.config.num_target_layers} layers but {name} has {layers}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            problems.append(
                f"drafter target_layer_ids {self.target_layer_ids} contain {bad}, out of range for a target with "
                f"{layers} layers (valid: 0..{layers - 1})"
            )
        if self.config.vocab_size != rows:
            problems.append(
                f"drafter vocab_size={self.config.vocab_size} but target {name} has {rows} embedding rows: "
                "wrong vocabulary"
            )
        if self.d2t is not None and int(self.d2t.max()) >= rows:
            problems.append(f"drafter d2t maps to ids >= {rows}, outside the target's vocabulary")
        if problems:
            raise ValueError(
                "; ".join(problems) + ". Use a drafter trained for this target (e.g. z-lab/Qwen3-4B-DFlash-b16 for "
                "Qwen/Qwen3-4B), or build one with BlockDiffusionDrafter.from_target(target) and train it."
            )
        if self.mask_token_id is None or not 0 <= self.mask_token_id < rows:
            raise ValueError(
                f"drafter mask_token_id={self.mask_token_id} is not a row of the target's embedding table "
                f"(0..{rows - 1}). Set `dflash_config.mask_token_id` to an id the target never produces."
            )

    # -------------------------------------------------------------------------------------- construction
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        *,
        num_context_layers: int = 5,
        mask_token_id: int | None = None,
        draft_vocab: list[int] | torch.Tensor | None = None,
        dflash2: Mapping[str, int] | None = None,
    ) -> BlockDiffusionDrafter:
        """A freshly initialised drafter sized for a Llama/Qwen-style causal LM `target`.

        Args:
            target: the causal LM the drafter will serve (its embedding and LM head are borrowed).
            num_hidden_layers: number of draft decoder layers.
            block_size: training/default block size.
            target_layer_ids: target layers feeding the context; default spreads `num_context_layers`
                ids over the target like DFlash does.
            mask_token_id: id filling the draft slots; default: the last row of the target's embedding table.
            draft_vocab: target ids the drafter may propose (a reduced draft vocabulary); default: all.
            dflash2: a DFlash 2 drafter with these sizes (`DFLASH2_FIELDS`; e.g. `DFLASH2_DEFAULT_SIZES`, its
                convolutions starting as the identity); default: DFlash (v1). Needs the full vocabulary.
        """
        text_config = target.config.get_text_config()
        num_target_layers = text_config.num_hidden_layers
        if target_layer_ids is None:
            # Deduplicated: on very shallow targets DFlash's spread repeats ids.
            spread = build_target_layer_ids(num_target_layers, min(num_context_layers, num_target_layers))
            target_layer_ids = sorted(set(spread))
        num_embeddings = target.get_input_embeddings().weight.shape[0]
        if mask_token_id is None:
            mask_token_id = num_embeddings - 1
        rope = getattr(text_config, "rope_parameters", None)
        config = BlockDiffusionConfig(
            vocab_size=num_embeddings,
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=text_config.num_attention_heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
            head_dim=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads,
            hidden_act=getattr(text_config, "hidden_act", "silu"),
            max_position_embeddings=text_config.max_position_embeddings,
            rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope) if rope else None,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config={
                "mask_token_id": int(mask_token_id),
                "target_layer_ids": list(target_layer_ids),
                **(dflash2 or {}),
            },
            draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
            dtype=target.dtype,
        )
        drafter = cls(config)
        if draft_vocab is not None:
            drafter.d2t.copy_(torch.as_tensor(draft_vocab, dtype=torch.long))
        drafter.check_compatible(target)
        return drafter.to(device=target.device, dtype=target.dtype)
