"""Faster few-row linear layers on CPU: what makes a verify round cost about one plain step.

Speculative decoding runs the target over a handful of tokens per round. On CPU, PyTorch's default
`F.linear` (an `x @ W.T` GEMM through MKL) is far slower for 2-32 rows than for one: measured on this
project's 2-core machine with SmolLM2-135M, one target forward over 4 tokens took 52 ms against 31 ms for
one token. The same product computed as `(W @ x.T).T` runs at GEMV speed for few rows (4 tokens: 33 ms),
and is never slower up to 32 rows. `skinny_linears` swaps that formulation into the `nn.Linear` modules of
the given models for the duration of a block; one row (plain decoding), many rows (prefill), non-CPU tensors
and dtypes other than float32 keep `F.linear` (in bfloat16 the stock kernel was the faster one here: 1.6 vs
3.4 ms for the 4-row LM head). The results agree with `F.linear` to float rounding.

    with hf_blockpilot.skinny_linears(target, drafter):
        target.generate(**inputs, assistant_model=drafter)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

#: Up to this many rows `(W @ x.T).T` was measured faster than `F.linear` on CPU (and never slower).
SKINNY_MAX_ROWS = 32


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int = SKINNY_MAX_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ x.T).T` for 2..max_rows float32 rows on CPU."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 1 < rows <= max_rows:
        return F.linear(x, weight, bias)
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _skinny_forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias, max_rows)


def use_skinny_linears(*models: nn.Module, max_rows: int = SKINNY_MAX_ROWS) -> Callable[[], None]:
    """Route every plain `nn.Linear` of `models` through `skinny_linear`; returns the function that undoes it.

    Modules whose `forward` is already overridden on the instance (accelerate offload hooks, an enclosing
    `skinny_linears`) are left alone, so nesting is safe and hooks keep working.
    """
    patched = []
    for model in models:
        for module in model.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                module.forward = partial(_skinny_forward, module, max_rows)
                patched.append(module)

    def undo() -> None:
        for module in patched:
            module.__dict__.pop("forward", None)

    return undo


@contextmanager
def skinny_linears(*models: nn.Module, max_rows: int = SKINNY_MAX_ROWS) -> Iterator[None]:
    """Within the block, the `nn.Linear` layers of `models` use `skinny_linear` (see the module docstring)."""
    undo = use_skinny_linears(*models, max_rows=max_rows)
    try:
        yield
    finally:
        undo()
