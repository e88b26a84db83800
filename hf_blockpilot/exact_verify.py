"""The exact verify path on CPU: verify forwards that round as plain decoding's one-token steps.

CPU kernels round a forward over several tokens unlike one-token steps, so a near-tie can flip a greedy choice.
`verify_view` (the one place that decides how a call verifies) gives each call its own view of the target
in which a verify forward computes attention one query at a time (`slotwise_exact_attention`) and linear layers
through `row_kernel` (every row in one pass over the weight, each rounded as one row) where it probes exact,
else in products of as many rows as this machine's kernels round alike (`row_exact_rows`). Calibration probes the
whole path (`probe_exact_verify`) and times it, so decisions weigh its cost (docs/exactness.md: which kernels
differ on which CPUs).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention_kernel import exact_parts, one_query_calls
from .kernel_build import load_kernel
from .row_kernel import RowKernel, exact_row_kernel, order_probe

#: The keys each row of a verify forward attends over (`slot_key_lengths`), in this thread / task.
_slot_key_lengths: contextvars.ContextVar[tuple[list[int], list[int], bool] | None] = contextvars.ContextVar(
    "hf_blockpilot_slot_key_lengths", default=None
)
#: The name `slotwise_exact_attention` is registered under.
SLOTWISE_EXACT_ATTENTION = "hf_blockpilot_slotwise_exact_sdpa"


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
    """Transformers' SDPA attention for verify forwards (`hf_blockpilot.batched`): each row's query slot is computed as
    that row's one-token decoding step computes it in plain batched `generate` (the same SDPA call as Transformers'
    `sdpa_attention_forward` makes for one query), alone, over exactly the keys plain decoding holds then (PyTorch's
    SDPA rounds differently when masked keys trail), with the row's mask, or none where plain decoding passes none
    (`slot_key_lengths`). A row's padding slots are skipped (left zero). The prefill, a one-token step of rows of one
    length, and forwards outside `slot_key_lengths` keep the stock path. Wherever one row's unmasked query is computed
    alone (a single row's one-token step or verify slots), `attention_kernel.one_query_calls` computes it in one call
    where it probes bit-equal to SDPA (bfloat16 or float32 on AVX-512 CPUs), faster."""
    plan = _slot_key_lengths.get()
    q_len = query.shape[2]
    stock_call = (
        attention_mask is None and not dropout and all(kwargs.get(n) is None for n in ("position_bias", "softcap"))
    )
    if stock_call and q_len == 1 and query.shape[0] == 1:  # a single row's one-token step, or its only slot
        attended = one_query_calls(query, key, value, scaling)
        if attended is not None:
            return attended.transpose(1, 2), None
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
    if masked and batch > 1 and slot_calls_match_sdpa(query.dtype, heads, groups if pack else 1, head_dim):
        mask = additive_mask(attention_mask, query.dtype)
        out = slot_calls().masked_slot_calls(query, key, value, mask, lengths, slots, scaling, groups if pack else 1)
        return out, None
    out = query.new_zeros(batch, q_len, heads, value.shape[-1])
    for r, (length, count) in enumerate(zip(lengths, slots, strict=True)):
        keys, values = key[r : r + 1, :, : length + count], value[r : r + 1, :, : length + count]
        # a single row's slots in one kernel call; a batch's keep SDPA: its calibration times unmasked rows of one
        # length, while real batches are padded (masked) rows, which the kernel does not serve
        served = batch == 1 and not masked and count
        row = one_query_calls(query[:, :, :count], keys, values, scaling) if served else None
        if row is not None:
            out[r, :count] = row[0].transpose(0, 1)
            continue
        for i in range(count):
            q = query[r : r + 1, :, i : i + 1]
            if pack:
                q = q.reshape(1, heads // groups, groups, head_dim)
            k, v = keys[:, :, : length + i + 1], values[:, :, : length + i + 1]
            mask = attention_mask[r : r + 1, :, i : i + 1, : length + i + 1] if masked else None
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, **gqa)
            out[r, i] = attended.reshape(heads, -1)
    return out, None


@functools.cache
def slot_calls() -> Any | None:
    """The built `kernels/slot_calls.cpp` (`masked_slot_calls`), cached per process; `None` where it is switched off
    (`HF_BLOCKPILOT_SLOT_CALLS=0`) or cannot be built (`kernel_build.load_kernel`)."""
    if os.environ.get("HF_BLOCKPILOT_SLOT_CALLS", "1") == "0":
        return None
    return load_kernel(Path(__file__).parent / "kernels" / "slot_calls.cpp")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA converts it (0 where attended, -inf elsewhere, in `dtype`); others as given."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


#: (dtype, query heads, queries packed a key/value head, head dim) -> whether `masked_slot_calls` gives SDPA's bits.
_slot_calls_match: dict[tuple, bool] = {}
#: (keys, masked leading keys) of each row of `slot_calls_match_sdpa`'s probe.
SLOT_CALL_PROBES = ((1, 0), (37, 5), (130, 1), (300, 40))


def slot_calls_match_sdpa(dtype: torch.dtype, heads: int, groups: int, head_dim: int) -> bool:
    """Whether `slot_calls` is built and its `masked_slot_calls` gives every slot exactly what the slot's own
    `F.scaled_dot_product_attention` call gives it with the boolean mask (query heads packed `groups` a key/value
    head, as Transformers packs masked one-query calls), probed once per layout on random rows with leading masked
    keys (as padding has), two slots each."""
    key = (dtype, heads, groups, head_dim)
    if key not in _slot_calls_match:
        module = slot_calls()
        matches = module is not None
        generator = torch.Generator().manual_seed(0)
        for keys, masked in SLOT_CALL_PROBES if matches else ():
            q = torch.randn(1, heads, 2, head_dim, generator=generator).to(dtype)
            k, v = (torch.randn(1, heads // groups, keys + 1, head_dim, generator=generator).to(dtype) for _ in "kv")
            mask = torch.ones(1, 1, 2, keys + 1, dtype=torch.bool)
            mask[..., :masked] = False
            out = module.masked_slot_calls(q, k, v, additive_mask(mask, dtype), [keys - 1], [2], None, groups)
            for i in range(2):
                one = q[:, :, i : i + 1].reshape(1, heads // groups, groups, head_dim)
                m = mask[:, :, i : i + 1, : keys + i]
                sdpa = F.scaled_dot_product_attention(one, k[:, :, : keys + i], v[:, :, : keys + i], attn_mask=m)
                matches = matches and torch.equal(out[0, i], sdpa.reshape(heads, -1))
        _slot_calls_match[key] = matches
    return _slot_calls_match[key]


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


def needs_exact_verify(model: nn.Module) -> bool:
    """Whether a verify forward of `model` takes the exact path (`verify_view`): every model on CPU, whose
    kernels round k rows or masked queries unlike one on every CPU seen (docs/exactness.md)."""
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
    gives every row exactly the result it gives that row alone, probed once per shape, bias, dtype and device on
    many small inputs (some kernels differ on some inputs only), then three of `ROW_PROBE_LIMIT` rows, and on
    `order_probe`s of both sizes (a k-row product that sums in another order than one row's agrees with it on
    random inputs nearly always: an AMX Xeon's 64 x 64 bfloat16 products did on every random probe)."""
    key = _row_exact_key(weight, bias)
    if key not in _row_exact_rows:
        generator = torch.Generator().manual_seed(0)
        exact = ROW_PROBE_LIMIT
        trials = [(SMALL_PROBE_ROWS, 8.0 ** (i % 3 - 1)) for i in range(SMALL_PROBE_TRIALS)]
        trials += [(ROW_PROBE_LIMIT, 1.0), (ROW_PROBE_LIMIT, 8.0), (ROW_PROBE_LIMIT, 0.125)]
        with torch.no_grad():
            probes = [
                ((scale * torch.randn(rows, weight.shape[1], generator=generator)).to(weight), weight)
                for rows, scale in trials
            ]
            probes += [order_probe(weight, rows, generator) for rows in (SMALL_PROBE_ROWS, ROW_PROBE_LIMIT)]
            for x, w in probes:
                rows = min(x.shape[0], exact)
                alone = torch.cat([F.linear(x[i : i + 1], w, bias) for i in range(rows)])
                checked = [m for m in _PROBED_ROWS if m <= rows]
                exact = next((m - 1 for m in checked if not torch.equal(F.linear(x[:m], w, bias), alone[:m])), exact)
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


def _row_exact_forward(module: nn.Linear, chunk: int, step_rows: int, x: torch.Tensor) -> torch.Tensor:
    if _slot_key_lengths.get() is None:  # a verify forward's only: prefills run as plain ones
        return F.linear(x, module.weight, module.bias)
    if step_rows > chunk and x.dim() == 3:  # a batch whose plain step is itself one product of step_rows rows
        return _as_plain_steps(module, step_rows, x)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows <= chunk:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    groups = -(-rows // chunk)
    padded = flat.new_zeros(groups * chunk, x.shape[-1])  # a row rounds alike in any product of <= chunk rows
    padded[:rows] = flat
    out = _products(module, padded.view(groups, chunk, -1))
    return out.reshape(groups * chunk, -1)[:rows].reshape(*x.shape[:-1], -1)


def _row_kernel_forward(module: nn.Linear, kernel: RowKernel, as_one_row: bool, x: torch.Tensor) -> torch.Tensor:
    """`kernel` in a verify forward; a single row through the stock product where that is what the kernel gives it
    (`as_one_row`: the way a step computes it stays the one the calibration timed)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows == 0 or (rows == 1 and as_one_row) or _slot_key_lengths.get() is None:  # a verify forward's only
        return F.linear(x, module.weight)
    return _kernel_product(kernel, module.weight, x)


def _kernel_product(kernel: RowKernel, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`kernel` over every row of `x` (..., in), shaped as `F.linear` shapes its output."""
    return kernel(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)


def _as_plain_steps(module: nn.Linear, step_rows: int, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a batch's (rows, slots, features) verify input, each slot's rows computed as one product of
    exactly `step_rows` rows (zero rows appended where rows have left the batch): as plain batched decoding
    computes every step. A row's rounding depends on its product's row count, not on the other rows."""
    rows, slots = x.shape[:2]
    padded = x.new_zeros(slots, step_rows, x.shape[-1])
    padded[:, :rows] = x.transpose(0, 1)
    return _products(module, padded)[:, :rows].transpose(0, 1)


def _products(module: nn.Linear, groups: torch.Tensor) -> torch.Tensor:
    """(G, m, out): `F.linear` of each of the G (m, in) products in `groups`, as one batched product where that
    probes to round every product as `F.linear` rounds it alone and to be faster (`batched_products_pay`), else
    one by one."""
    if batched_products_pay(module.weight, module.bias, groups.shape[1]):
        return batched_linear(groups, module.weight, module.bias)
    return torch.stack([F.linear(group, module.weight, module.bias) for group in groups])


def batched_linear(groups: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """G products of (m, in) rows with `weight` in one `torch.bmm` call (`baddbmm` with a bias), the weight
    broadcast to every product, not copied. MKL computes each float32 product with the kernel it takes for that
    product alone (a one-row product as a one-row product), but all of them in one call, spread over the threads
    (docs/exactness.md)."""
    count = groups.shape[0]
    weights = weight.t().unsqueeze(0).expand(count, -1, -1)
    if bias is None:
        return torch.bmm(groups, weights)
    return torch.baddbmm(bias.expand(count, groups.shape[1], -1), groups, weights)


#: (weight shape, bias or not, dtype, device type, rows a product) -> whether `batched_linear` is exact and faster.
_batched_products_pay: dict[tuple, bool] = {}
#: The probe's inputs of `batched_products_pay`: (products in one call, input scale); the last is also timed.
BATCHED_PROBES = ((2, 0.125), (5, 1.0), (4, 8.0))
#: Timed calls of each way in `batched_products_pay` (the fastest counts).
BATCHED_TIMINGS = 3


def batched_products_pay(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
    """Whether `batched_linear` gives every product of `rows` rows exactly what `F.linear` gives it alone (random
    inputs at three scales and product counts) and computes 4 such products faster than `F.linear` one by one
    (bfloat16 `bmm` has been 36x slower than its one-row product on a CPU); probed once per shape, bias, dtype,
    device and row count."""
    key = (*_row_exact_key(weight, bias), rows)
    if key not in _batched_products_pay:
        generator = torch.Generator().manual_seed(0)
        pays = True
        with torch.no_grad():
            for count, scale in BATCHED_PROBES:
                x = (scale * torch.randn(count, rows, weight.shape[1], generator=generator)).to(weight)
                alone = torch.stack([F.linear(group, weight, bias) for group in x])
                if not torch.equal(batched_linear(x, weight, bias), alone):
                    pays = False
                    break
            if pays:  # x: the last probe's products
                one_by_one = _fastest_s(lambda: [F.linear(group, weight, bias) for group in x])
                pays = _fastest_s(partial(batched_linear, x, weight, bias)) < one_by_one
        _batched_products_pay[key] = pays
    return _batched_products_pay[key]


def _fastest_s(run: Callable[[], Any]) -> float:
    """The fastest of `BATCHED_TIMINGS` calls of `run`, in seconds (CPU)."""
    times = []
    for _ in range(BATCHED_TIMINGS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


#: (weight shape, dtype, device type, rows a step, rows a stock product) -> whether the kernel pays.
_kernel_pays: dict[tuple, bool] = {}
#: Slots `kernel_pays` times: a verify of a few drafts.
KERNEL_TIMING_ROWS = 4


def kernel_pays(weight: torch.Tensor, kernel: RowKernel, step_rows: int, product_rows: int) -> bool:
    """Whether `kernel` computes a verify of `KERNEL_TIMING_ROWS` slots of `step_rows` rows with `weight` faster than
    the exact path computes them without it (stock products of `product_rows` rows each: one where the stock
    products round that many rows alike, else a chunk or one slot's rows), the fastest of `BATCHED_TIMINGS` calls
    each way, once per shape, dtype, device and row counts (native bfloat16 products are faster where they are exact,
    dot-product ones are not)."""
    rows = KERNEL_TIMING_ROWS * step_rows
    step = min(product_rows, rows)
    key = (tuple(weight.shape), weight.dtype, weight.device.type, step_rows, step)
    if key not in _kernel_pays:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight)
        with torch.no_grad():
            stock = _fastest_s(lambda: [F.linear(x[i : i + step], weight) for i in range(0, rows, step)])
            _kernel_pays[key] = _fastest_s(partial(kernel, x, weight)) < stock
    return _kernel_pays[key]


#: (weight shape, bias or not, dtype, device type, parts) -> whether `split_linear` rounds as `F.linear`.
_split_products_exact: dict[tuple, bool] = {}
#: Input scales `split_parts` probes one-row products at.
SPLIT_PROBE_SCALES = (0.125, 1.0, 8.0, 64.0)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """`F.linear` of one row (`x`: (..., in) holding one row) as `parts` products over slices of the weight's
    outputs, in one `torch.bmm` call (each output is still one dot product over every input): PyTorch spreads
    the parts over its threads, where MKL runs a one-row float32 product on one thread."""
    out_features, in_features = weight.shape
    slices = weight.view(parts, out_features // parts, in_features).transpose(1, 2)
    row = x.reshape(1, 1, in_features).expand(parts, 1, in_features)
    if bias is None:
        out = torch.bmm(row, slices)
    else:
        out = torch.baddbmm(bias.view(parts, 1, -1), row, slices)
    return out.reshape(*x.shape[:-1], out_features)


def split_parts(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """How many parts `split_linear` computes a one-row product with `weight` in: PyTorch's thread count (at
    least 2) where that divides the outputs and the split probes to round every output as one-row `F.linear`
    does (once per shape, bias, dtype, device and parts, on inputs at four scales and an `order_probe`); 1 (no
    split) elsewhere."""
    parts = max(torch.get_num_threads(), 2)
    if weight.dim() != 2 or weight.shape[0] % parts:
        return 1
    key = (*_row_exact_key(weight, bias), parts)
    if key not in _split_products_exact:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            probes = [
                ((scale * torch.randn(1, weight.shape[1], generator=generator)).to(weight), weight)
                for scale in SPLIT_PROBE_SCALES
            ]
            probes.append(order_probe(weight, 1, generator))
            _split_products_exact[key] = all(
                torch.equal(split_linear(x, w, bias, parts), F.linear(x, w, bias)) for x, w in probes
            )
    return parts if _split_products_exact[key] else 1


#: How a single request's one-token steps may compute their one-row products (`CostModel.one_row_steps`): each
#: linear's own forward, split over the threads (`split_linear`), or `row_kernel`; each only where it probes bit-equal.
ONE_ROW_STEPS = ("stock", "split", "kernel")


def one_row_product(module: nn.Linear, how: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`module`'s one-row product computed `how` (one of `ONE_ROW_STEPS`), bit-equal to one-row `F.linear`: the
    split where `split_parts` probes it so, the kernel where `exact_row_kernel` finds one (bias-free weights); `None`
    for "stock" and where the way does not probe bit-equal for this weight."""
    if how not in ONE_ROW_STEPS:
        raise ValueError(f"one-row steps are computed one of the ways {ONE_ROW_STEPS}, got {how!r}")
    weight, bias = module.weight, module.bias
    if how == "split":
        parts = split_parts(weight, bias)
        return None if parts == 1 else partial(split_linear, weight=weight, bias=bias, parts=parts)
    kernel = exact_row_kernel(weight) if how == "kernel" and bias is None else None
    if kernel is not None:
        return partial(_kernel_product, kernel, weight)
    return None


def takes_one_row_products(model: nn.Module, how: str) -> bool:
    """Whether some linear the exact path serves (`_exact_path_linears`) computes its one-row products `how`
    (`one_row_product`): a way none takes changes no step, so the calibration need not time it."""
    return any(one_row_product(module, how) is not None for module in _exact_path_linears(model))


def _exact_path_linears(model: nn.Module) -> Iterator[nn.Linear]:
    """The plain `nn.Linear`s of `model` the exact path may route (`use_row_exact_linears`): not one whose `forward`
    is overridden on the instance (an accelerate offload hook)."""
    return (m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__)


def _one_row_forward(
    one_row: Callable[[torch.Tensor], torch.Tensor], forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    return one_row(x) if x.numel() == x.shape[-1] else forward(x)


def use_row_exact_linears(model: nn.Module, step_rows: int, one_row_steps: str = "stock") -> None:
    """Make every plain `nn.Linear` of `model` (a `call_view`: this changes it) compute a verify forward (within
    `slot_key_lengths`) as plain decoding's steps of `step_rows` rows compute it. A bias-free linear takes a kernel
    that reads the weight once for all rows (`exact_row_kernel`) where one probes bit-equal to the step's products
    (as one row where products of `step_rows` rows round every row alike, `row_exact_rows`; else as products of
    `step_rows` rows) and is faster than the way below (`kernel_pays`). Otherwise, a weight that does not round every
    row alike up to `ROW_PROBE_LIMIT` rows computes it in chunks no larger than `row_exact_rows` where those steps fit
    in one such chunk (each row then rounds as it rounds alone), else slot by slot as products of exactly `step_rows`
    rows (`_as_plain_steps`). `one_row_steps` (not "stock"): a one-row input, anywhere, is computed that way where it
    probes bit-equal (`one_row_product`), so a single request's one-token steps give plain decoding's logits faster
    (which way is timed at calibration: `CostModel.one_row_steps`). A linear whose `forward` is overridden on the
    instance (an accelerate offload hook) is left alone."""
    for module in _exact_path_linears(model):
        chunk = row_exact_rows(module.weight, module.bias)
        alike = step_rows <= chunk  # a step's product rounds each row as one row
        kernel = exact_row_kernel(module.weight, 1 if alike else step_rows) if module.bias is None else None
        if kernel is not None and kernel_pays(module.weight, kernel, step_rows, chunk if alike else step_rows):
            module.forward = partial(_row_kernel_forward, module, kernel, alike)
        elif chunk < ROW_PROBE_LIMIT:
            module.forward = partial(_row_exact_forward, module, chunk, step_rows)
        one_row = one_row_product(module, one_row_steps)
        if one_row is not None:
            module.forward = partial(_one_row_forward, one_row, module.forward)


def call_view(model: nn.Module) -> nn.Module:
    """A view of `model` for one call: every module shallow-copied (no tensor copied; its parameter, buffer and hook
    tables and the config copied), so the exact path switched on in the view and hooks Transformers attaches during the
    call are that call's own: another thread or call using `model` never sees them."""
    config = getattr(model, "config", None)
    own = copy.copy(config)

    def view_of(module: nn.Module) -> nn.Module:
        view = object.__new__(type(module))  # what `copy.copy` makes of a module (its default reduce), directly
        tables = module.__dict__.copy()
        for name, value in tables.items():
            if type(value) in (dict, OrderedDict, set):
                tables[name] = value.copy()
        children = module._modules.items()
        tables["_modules"] = {name: None if child is None else view_of(child) for name, child in children}
        if config is not None and tables.get("config") is config:
            tables["config"] = own
        view.__dict__ = tables
        return view

    return view_of(model)


def prepare_attention_kernels(model: PreTrainedModel, batch_size: int) -> None:
    """Build and probe, before a call decodes, the attention kernels its verify forwards may take for `model`'s head
    layout (a single row's `attention_kernel.exact_parts`, a batch's `slot_calls_match_sdpa`): a one-time build or
    probe then never lands inside a round, where the speculation guard's clock would count it as the round's cost."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weight = next(model.parameters())
    if weight.device.type != "cpu" or heads % kv_heads:
        return
    if batch_size == 1:
        exact_parts(heads, kv_heads, head_dim, weight.dtype)
    else:  # a padded batch's masked calls pack the query heads of a key/value head (`slotwise_exact_attention`)
        slot_calls_match_sdpa(weight.dtype, heads, heads // kv_heads, head_dim)


def verify_view(target: nn.Module, batch_size: int = 1, one_row_steps: str = "stock") -> nn.Module:
    """What a speculative call verifies with (the one place that decides it; calibration times and probes the
    same): on CPU (`needs_exact_verify`) a `call_view` of `target` on the exact path, `slotwise_exact_attention`
    with `use_row_exact_linears` for plain steps of `batch_size` rows in the forwards within `slot_key_lengths`,
    so greedy output equals plain decoding bit for bit; elsewhere `target` itself, on the stock kernels. `target`
    is never changed, so nothing needs undoing. `one_row_steps` (a single request: the way the calibration timed
    fastest, `CostModel.one_row_steps`): the view's one-row products are computed that way, bit-equal (batches keep
    "stock": their steps have several rows); a single row's one-token steps run on the view, its one-query
    attention on `attention_kernel` where that probes bit-equal."""
    if not needs_exact_verify(target):
        return target
    view = call_view(target)
    sdpa = isinstance(view, PreTrainedModel) and getattr(view.config, "_attn_implementation", None) == "sdpa"
    if sdpa and view._can_set_attn_implementation():  # its attention goes through `AttentionInterface`
        view.set_attn_implementation(SLOTWISE_EXACT_ATTENTION)
        prepare_attention_kernels(view, batch_size)
    use_row_exact_linears(view, batch_size, one_row_steps if batch_size == 1 else "stock")
    return view
