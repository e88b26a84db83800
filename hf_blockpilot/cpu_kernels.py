"""Faster few-token forwards on CPU: what makes a verify round cost about one plain step.

Speculative decoding runs the target over a handful of tokens per round; two stock CPU paths make such a
forward far dearer than a one-token step, and `cpu_verify_kernels` replaces both for the duration of a block:

- **Linear layers.** PyTorch's `F.linear` (an `x @ W.T` GEMM through MKL) is far slower for 2-32 rows than for
  one; the same product computed as `(W @ x.T).T` (`skinny_linear`) runs at GEMV speed for few rows. One row
  (plain decoding), many rows (prefill), non-CPU tensors and dtypes other than float32 keep `F.linear`.
- **Attention with grouped key/value heads** (GQA: SmolLM2, Llama 3, Qwen3). For more than one query with a
  mask, Transformers' SDPA path copies every cached key and value `num_key_value_groups` times and PyTorch then
  falls back to its math kernel, which scales another copy of the keys: work and fresh memory that grow with
  the context, paid in every layer of every verify round, while a one-token step needs none of it.
  `grouped_query_attention` stacks the query heads that share a key/value head as extra query rows instead,
  so nothing is repeated.

Both agree with the stock kernels to float rounding only, and rounding is what greedy equality cannot spare:
`generate` switches them on only for the row counts where this machine's calibration found them both exact
(`probe_exact_verify`) and faster (`CostModel.kernel_rows`); on the CPUs seen so far they are never exact, and
every verify takes the exact path instead (`use_verify_kernels`, docs/exactness.md). `rows=` switches them on
by hand.

    with hf_blockpilot.cpu_verify_kernels(target, drafter):
        target.generate(**inputs, assistant_model=drafter)
"""

from __future__ import annotations

import contextvars
import copy
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import grouped_sdpa

#: Up to this many rows `(W @ x.T).T` is faster than `F.linear` on CPU (docs/design-measurements.md); the grouped
#: attention serves the same range of query lengths.
SKINNY_MAX_ROWS = 32

#: The row counts the kernels serve unless told otherwise.
DEFAULT_ROWS = frozenset(range(2, SKINNY_MAX_ROWS + 1))
#: The query lengths `grouped_query_attention` serves in this thread / task (set by `use_grouped_query_attention`).
_attention_rows: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "hf_blockpilot_attention_rows", default=DEFAULT_ROWS
)

#: The name `one_token_exact_attention` is registered under.
ONE_TOKEN_EXACT_ATTENTION = "hf_blockpilot_one_token_exact_sdpa"

#: The keys each row of a batched verify forward attends over (`slot_key_lengths`), in this thread / task.
_slot_key_lengths: contextvars.ContextVar[tuple[list[int], list[int], bool] | None] = contextvars.ContextVar(
    "hf_blockpilot_slot_key_lengths", default=None
)
#: The name `slotwise_exact_attention` is registered under.
SLOTWISE_EXACT_ATTENTION = "hf_blockpilot_slotwise_exact_sdpa"

#: The name `grouped_query_attention` is registered under in Transformers' attention (and mask) interfaces.
GROUPED_QUERY_ATTENTION = "hf_blockpilot_grouped_sdpa"


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: Collection[int] = DEFAULT_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ x.T).T` for float32 CPU inputs whose row count is in
    `rows` (default 2..`SKINNY_MAX_ROWS`)."""
    num_rows = x.numel() // x.shape[-1] if x.numel() else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or num_rows not in rows:
        return F.linear(x, weight, bias)
    out = (weight @ x.reshape(num_rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _skinny_forward(module: nn.Linear, rows: frozenset[int], x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias, rows)


def use_skinny_linears(*models: nn.Module, rows: Collection[int] = DEFAULT_ROWS) -> Callable[[], None]:
    """Route every plain `nn.Linear` of `models` through `skinny_linear`; returns the function that undoes it.

    Modules whose `forward` is already overridden on the instance (accelerate offload hooks, an enclosing
    `skinny_linears`) are left alone, so nesting is safe and hooks keep working.
    """
    return _patch_linears(models, lambda module: partial(_skinny_forward, module, frozenset(rows)))


def _patch_linears(
    models: Sequence[nn.Module], forward_for: Callable[[nn.Linear], Callable | None]
) -> Callable[[], None]:
    """Give every plain `nn.Linear` of `models` whose `forward` is not already overridden on the instance the
    forward `forward_for(module)` returns (`None`: leave it); returns the function that undoes it."""
    patched = []
    for model in models:
        for module in model.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                forward = forward_for(module)
                if forward is not None:
                    module.forward = forward
                    patched.append(module)

    def undo() -> None:
        for module in patched:
            module.__dict__.pop("forward", None)

    return undo


@contextmanager
def skinny_linears(*models: nn.Module, rows: Collection[int] = DEFAULT_ROWS) -> Iterator[None]:
    """Within the block, the `nn.Linear` layers of `models` use `skinny_linear` (see the module docstring)."""
    undo = use_skinny_linears(*models, rows=rows)
    try:
        yield
    finally:
        undo()


def grouped_query_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention function, with masked queries on CPU computed per key/value head
    (`grouped_sdpa`), so the cached keys/values are used as they are, for the query lengths switched on
    (default 2..`SKINNY_MAX_ROWS`). Anything else goes to Transformers' own `sdpa_attention_forward`."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    stock = (
        query.device.type != "cpu"
        or groups == 1
        or q_len not in _attention_rows.get()
        or attention_mask is None  # causal prefill: stock SDPA's `is_causal` path
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1  # a mask per head
        or dropout
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))
    )
    if stock:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = grouped_sdpa(query, key, value, attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_QUERY_ATTENTION, grouped_query_attention)
AttentionMaskInterface.register(GROUPED_QUERY_ATTENTION, sdpa_mask)  # the masks SDPA gets


def one_token_exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, with each of several queries computed as a one-token decoding step
    computes it: alone, over the keys up to its own position, unmasked (PyTorch's SDPA rounds several masked
    queries unlike one). With row-exact linears a verify forward then returns, bit for bit, the logits plain
    decoding would. The prefill (nothing cached yet) keeps the stock path, as plain decoding's. For unpadded
    sequences only."""
    q_len = query.shape[2]
    past = key.shape[2] - q_len
    if q_len == 1 or past == 0 or query.device.type != "cpu":  # a decoding step, or the prefill: as plain decoding
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kwargs = {**kwargs, "is_causal": False}
    rows = [
        sdpa_attention_forward(
            module,
            query[:, :, i : i + 1],
            key[:, :, : past + i + 1],
            value[:, :, : past + i + 1],
            None,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )[0]
        for i in range(q_len)
    ]
    return torch.cat(rows, dim=1), None


AttentionInterface.register(ONE_TOKEN_EXACT_ATTENTION, one_token_exact_attention)
AttentionMaskInterface.register(ONE_TOKEN_EXACT_ATTENTION, sdpa_mask)


def slotwise_exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`one_token_exact_attention` for a batch's verify forwards (`hf_blockpilot.batched`): each row's query slot
    is computed as that row's one-token decoding step computes it in plain batched `generate` (the same SDPA call
    as Transformers' `sdpa_attention_forward` makes for one query), alone, over exactly the keys plain decoding
    holds then (PyTorch's SDPA rounds differently when masked keys trail), with the row's mask, or none where
    plain decoding passes none (`slot_key_lengths`). A row's padding slots are skipped (left zero). The prefill, a
    one-token step of rows of one length, and forwards outside `slot_key_lengths` keep the stock path."""
    plan = _slot_key_lengths.get()
    q_len = query.shape[2]
    lockstep = plan is not None and q_len == 1 and len(set(plan[0])) == 1  # one step, no row's keys trail masked
    if plan is None or lockstep or key.shape[2] == q_len or query.device.type != "cpu" or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    lengths, slots, masked = plan
    batch, heads, _, head_dim = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    # what `sdpa_attention_forward` does for one query: GQA inside SDPA when unmasked, else query heads packed
    # as rows of their key/value head
    gqa = {"enable_gqa": True} if groups > 1 and not masked and head_dim <= 256 else {}
    pack = groups > 1 and masked
    out = query.new_zeros(batch, q_len, heads, value.shape[-1])
    for r, (length, count) in enumerate(zip(lengths, slots, strict=True)):
        for i in range(count):
            end = length + i + 1
            q = query[r : r + 1, :, i : i + 1]
            if pack:
                q = q.reshape(1, heads // groups, groups, head_dim)
            attended = F.scaled_dot_product_attention(
                q,
                key[r : r + 1, :, :end],
                value[r : r + 1, :, :end],
                attn_mask=attention_mask[r : r + 1, :, i : i + 1, :end] if masked else None,
                scale=scaling,
                **gqa,
            )
            out[r, i] = attended.reshape(heads, -1)
    return out, None


@contextmanager
def slot_key_lengths(lengths: list[int], slots: list[int], masked: bool) -> Iterator[None]:
    """Within the block, `slotwise_exact_attention` computes row r's first `slots[r]` slots, slot i over its first
    `lengths[r] + i + 1` keys, with the 4-D mask if `masked` (plain batched decoding passes one when any prompt
    is padded)."""
    token = _slot_key_lengths.set((lengths, slots, masked))
    try:
        yield
    finally:
        _slot_key_lengths.reset(token)


AttentionInterface.register(SLOTWISE_EXACT_ATTENTION, slotwise_exact_attention)
AttentionMaskInterface.register(SLOTWISE_EXACT_ATTENTION, sdpa_mask)


def _switch_sdpa(models: Sequence[nn.Module], implementation: str) -> Callable[[], None]:
    """Switch the Transformers models among `models` that use SDPA attention to `implementation`; returns the
    function that switches them back. Other models (eager, flash, a drafter) are left alone."""
    switched = [
        model
        for model in models
        if isinstance(model, PreTrainedModel)
        and getattr(model.config, "_attn_implementation", None) == "sdpa"
        and model._can_set_attn_implementation()  # its attention goes through `AttentionInterface`
    ]
    for model in switched:
        model.set_attn_implementation(implementation)

    def undo() -> None:
        for model in switched:
            model.set_attn_implementation("sdpa")

    return undo


def use_one_token_exact_attention(*models: nn.Module) -> Callable[[], None]:
    """Switch the SDPA models among `models` to `one_token_exact_attention`; returns the function that switches
    them back."""
    return _switch_sdpa(models, ONE_TOKEN_EXACT_ATTENTION)


def needs_exact_verify(model: nn.Module) -> bool:
    """Whether a verify forward of `model` takes the exact path (`use_verify_kernels`): every model on CPU.

    CPU kernels round a product of k rows unlike k products of one row (MKL's float32 GEMM against its GEMV on
    every CPU seen; oneDNN's bfloat16 kernels for long reductions on an AMD EPYC with AVX512-BF16, never on an
    Intel Xeon with AMX), and PyTorch's SDPA rounds several masked queries unlike one: a near-tie can then flip a
    greedy choice. Calibration probes that the path is exact here (`probe_exact_verify`)."""
    return next(model.parameters()).device.type == "cpu"


#: (weight shape, bias or not, dtype, device type) -> the most rows `F.linear` computes as it computes one.
_row_exact_rows: dict[tuple, int] = {}
#: How many rows `row_exact_rows` tries at most.
ROW_PROBE_LIMIT = 128
#: `row_exact_rows` first tries this many inputs of this many rows.
SMALL_PROBE_TRIALS, SMALL_PROBE_ROWS = 16, 8
#: The row counts `row_exact_rows` tries: every count a single request verifies, then the edges of the
#: power-of-two blocks kernels switch at.
_PROBED_ROWS = sorted({*range(2, 18), *(1 << i for i in range(5, 8)), *((1 << i) + 1 for i in range(4, 7))})


def row_exact_rows(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """The most rows (a power of two up to `ROW_PROBE_LIMIT`; 1: none) for which `F.linear(x, weight, bias)`
    gives every row exactly the result it gives that row alone, probed once per shape, bias, dtype and device.
    BLAS libraries switch kernels, and rounding, with the row count: MKL's float32 GEMM at 2 rows, oneDNN's AMX
    bfloat16 kernels at 33 rows for the down projections and LM heads of small models, an AMD EPYC's AVX512-BF16
    kernels at 2 rows for reductions over more than 1024 inputs, where only some inputs show it: so many small
    inputs (the counts a single request verifies), then three of `ROW_PROBE_LIMIT` rows."""
    key = _row_exact_key(weight, bias)
    if key not in _row_exact_rows:
        generator = torch.Generator().manual_seed(0)
        exact = ROW_PROBE_LIMIT
        trials = [(SMALL_PROBE_ROWS, 8.0 ** (i % 3 - 1)) for i in range(SMALL_PROBE_TRIALS)]
        with torch.no_grad():
            for rows, scale in trials + [(ROW_PROBE_LIMIT, 1.0), (ROW_PROBE_LIMIT, 8.0), (ROW_PROBE_LIMIT, 0.125)]:
                x = (scale * torch.randn(rows, weight.shape[1], generator=generator)).to(weight)
                alone = torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(min(rows, exact))])
                checked = [m for m in _PROBED_ROWS if m <= min(rows, exact)]
                exact = next(
                    (m - 1 for m in checked if not torch.equal(F.linear(x[:m], weight, bias), alone[:m])), exact
                )
        _row_exact_rows[key] = exact if exact == ROW_PROBE_LIMIT else 1 << (exact.bit_length() - 1)
    return _row_exact_rows[key]


def _row_exact_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return tuple(weight.shape), bias is not None, weight.dtype, weight.device.type


def row_exact_table(model: nn.Module) -> dict[str, int]:
    """`row_exact_rows` of every plain `nn.Linear` of `model` (probed where not known yet), keyed by text: what
    a calibration caches so that later processes on this machine skip the probe (`remember_row_exact`)."""
    table = {}
    for module in model.modules():
        if type(module) is nn.Linear:
            shape, bias, dtype, device = _row_exact_key(module.weight, module.bias)
            fields = ("x".join(map(str, shape)), "bias" if bias else "no bias", str(dtype).removeprefix("torch."))
            table["|".join((*fields, device))] = row_exact_rows(module.weight, module.bias)
    return table


def remember_row_exact(table: dict[str, int]) -> None:
    """Take `row_exact_rows` results probed earlier on this machine (a `row_exact_table`)."""
    for key, rows in table.items():
        shape, bias, dtype, device = key.split("|")
        entry = (tuple(int(n) for n in shape.split("x")), bias == "bias", getattr(torch, dtype), device)
        _row_exact_rows.setdefault(entry, int(rows))


class VerifyForwards:
    """Which of one request's target forwards verify drafts (`active` while one runs): the row-exact linears
    split those only, so a prefill of any length runs as plain decoding's."""

    def __init__(self) -> None:
        self.active = False


#: The single request's `VerifyForwards` in this thread / task (set by `use_verify_kernels`).
_verify_forwards: contextvars.ContextVar[VerifyForwards | None] = contextvars.ContextVar(
    "hf_blockpilot_verify_forwards", default=None
)


def set_verifying(active: bool) -> None:
    """Mark whether the target forward about to run (until the next call) verifies drafts."""
    marker = _verify_forwards.get()
    if marker is not None:
        marker.active = active


@contextmanager
def verifying() -> Iterator[None]:
    """The target forwards within the block verify drafts (see `set_verifying`)."""
    marker = _verify_forwards.get()
    before = marker.active if marker is not None else False
    set_verifying(True)
    try:
        yield
    finally:
        set_verifying(before)


def _in_verify_forward() -> bool:
    marker = _verify_forwards.get()
    return _slot_key_lengths.get() is not None or (marker is not None and marker.active)


def _row_exact_forward(module: nn.Linear, chunk: int, step_rows: int, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows <= chunk or not _in_verify_forward():  # a verify forward's only: prefills run as plain ones
        return F.linear(x, module.weight, module.bias)
    if step_rows > chunk and x.dim() == 3:  # a batch whose plain step is itself one product of step_rows rows
        return _as_plain_steps(module, step_rows, x)
    flat = x.reshape(rows, x.shape[-1])
    parts = [F.linear(flat[i : i + chunk], module.weight, module.bias) for i in range(0, rows, chunk)]
    return torch.cat(parts).reshape(*x.shape[:-1], -1)


def _as_plain_steps(module: nn.Linear, step_rows: int, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a batch's (rows, slots, features) verify input, each slot's rows computed as one product of
    exactly `step_rows` rows (zero rows appended where rows have left the batch): as plain batched decoding
    computes every step, all of its rows at once. The rounding of a row depends on the row count of its product
    (MKL's float32 GEMM has one class for 2-3, 5-7 and 9-11 rows and another for 4, 8 and 12 or more), not on the
    other rows or its place among them."""
    rows = x.shape[0]
    padded = x.new_zeros(step_rows, x.shape[-1])
    slots = []
    for i in range(x.shape[1]):
        padded[:rows] = x[:, i]
        slots.append(F.linear(padded, module.weight, module.bias)[:rows])
    return torch.stack(slots, dim=1)


def use_row_exact_linears(model: nn.Module, step_rows: int) -> Callable[[], None]:
    """Make every plain `nn.Linear` of `model` whose weight does not round every row alike up to
    `ROW_PROBE_LIMIT` rows compute a verify forward (a batch's within `slot_key_lengths`, a single request's while
    `set_verifying`) as plain decoding's steps of `step_rows` rows compute it: in chunks no larger than
    `row_exact_rows` of its weight where those steps fit in one such chunk (each row then rounds as it rounds
    alone), else slot by slot as products of exactly `step_rows` rows (`_as_plain_steps`). Returns the function
    that undoes it."""

    def forward_for(module: nn.Linear) -> Callable | None:
        chunk = row_exact_rows(module.weight, module.bias)
        return partial(_row_exact_forward, module, chunk, step_rows) if chunk < ROW_PROBE_LIMIT else None

    return _patch_linears([model], forward_for)


def use_grouped_query_attention(*models: nn.Module, rows: Collection[int] = DEFAULT_ROWS) -> Callable[[], None]:
    """Switch the Transformers models among `models` that use SDPA attention to `grouped_query_attention` for
    query lengths in `rows` (in this thread); returns the function that switches them back. Other models
    (eager, flash, a drafter) are left alone."""
    undo_switch = _switch_sdpa(models, GROUPED_QUERY_ATTENTION)
    token = _attention_rows.set(frozenset(rows))

    def undo() -> None:
        _attention_rows.reset(token)
        undo_switch()

    return undo


def use_cpu_verify_kernels(*models: nn.Module, rows: Collection[int] = DEFAULT_ROWS) -> Callable[[], None]:
    """`use_skinny_linears` and `use_grouped_query_attention` on `models` for forwards over `rows` tokens;
    returns the function that undoes both."""
    undo_linears = use_skinny_linears(*models, rows=rows)
    undo_attention = use_grouped_query_attention(*models, rows=rows)

    def undo() -> None:
        undo_attention()
        undo_linears()

    return undo


def call_view(model: nn.Module) -> nn.Module:
    """A view of `model` for one call: every module shallow-copied, its tables (parameters, buffers, hooks)
    copied but not what they hold (no tensor is copied), and the config the modules read copied, so kernels
    switched on in the view (a linear's `forward`, the attention implementation) and anything Transformers
    attaches to it during the call (output-capturing hooks) are that call's own: another thread or call using
    `model` never sees them."""
    config = getattr(model, "config", None)
    own = copy.copy(config)

    def view_of(module: nn.Module) -> nn.Module:
        cls = type(module)
        view = cls.__new__(cls)  # what `copy.copy` makes of a module (its default reduce), without the detour
        view.__dict__.update(
            {
                name: value.copy() if type(value) in (dict, OrderedDict, set) else value
                for name, value in vars(module).items()
            }
        )
        view._modules = {name: None if child is None else view_of(child) for name, child in module._modules.items()}
        if config is not None and getattr(module, "config", None) is config:
            view.config = own
        return view

    return view_of(model)


def use_verify_kernels(
    target: nn.Module, kernel_rows: Collection[int], unpadded: bool = True, batch_size: int = 1
) -> tuple[nn.Module, Callable[[], None]]:
    """What a speculative call verifies with (the one place that decides it; calibration times and probes the
    same): the CPU verify kernels for `kernel_rows` (only where this machine's calibration found them both
    exact and faster; a single request); else, on CPU (`needs_exact_verify`), the exact path: for an `unpadded`
    single request `one_token_exact_attention` and row-exact linears in the forwards marked by `set_verifying`,
    for a batch `slotwise_exact_attention` with `use_row_exact_linears`, so greedy output equals plain decoding
    bit for bit; else the stock kernels. Returns the model to run the call with (`target`, or a `call_view` of it
    with the kernels switched on, never `target` itself changed) and what ends the call's kernel settings."""
    if batch_size > 1:
        if not needs_exact_verify(target):
            return target, lambda: None
        view = call_view(target)
        _switch_sdpa([view], SLOTWISE_EXACT_ATTENTION)
        use_row_exact_linears(view, batch_size)
        return view, lambda: None
    if kernel_rows:
        view = call_view(target)
        return view, use_cpu_verify_kernels(view, rows=kernel_rows)  # resets the rows it serves in this context
    if not (unpadded and needs_exact_verify(target)):
        return target, lambda: None
    view = call_view(target)
    use_one_token_exact_attention(view)
    use_row_exact_linears(view, step_rows=1)
    token = _verify_forwards.set(VerifyForwards())
    return view, lambda: _verify_forwards.reset(token)


@contextmanager
def cpu_verify_kernels(*models: nn.Module, rows: Collection[int] = DEFAULT_ROWS) -> Iterator[None]:
    """Within the block, `models` run forwards over `rows` tokens (default 2..`SKINNY_MAX_ROWS`) with
    `skinny_linear` and `grouped_query_attention` (see the module docstring); other forwards (one-token steps,
    prefills) and non-CPU tensors keep the stock kernels."""
    undo = use_cpu_verify_kernels(*models, rows=rows)
    try:
        yield
    finally:
        undo()
