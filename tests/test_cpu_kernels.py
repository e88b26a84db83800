"""`skinny_linear(s)`: same numbers as `F.linear`, the few-row path really taken, patching undone, lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target
from torch import nn

from hf_blockpilot import cpu_kernels, skinny_linear, skinny_linears, use_skinny_linears


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 5, 24), (3, 4, 24), (32, 24), (40, 24), (0, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(shape, with_bias):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*shape, generator=gen), torch.randn(17, 24, generator=gen)
    bias = torch.randn(17, generator=gen) if with_bias else None
    got = skinny_linear(x, weight, bias)
    assert got.shape == (*shape[:-1], 17)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_few_rows_take_the_transposed_product_and_others_keep_linear(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(cpu_kernels.F, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    weight = torch.randn(8, 6)
    for rows in (1, 2, 7, 32, 33):
        skinny_linear(torch.randn(1, rows, 6), weight)
    assert calls == [(1, 1, 6), (1, 33, 6)]  # one row and more than max_rows: F.linear; 2..32: W @ x.T
    skinny_linear(torch.randn(1, 7, 6), weight, max_rows=4)
    assert calls[-1] == (1, 7, 6)
    skinny_linear(torch.randn(1, 5, 6, dtype=torch.bfloat16), weight.bfloat16())  # bf16: the stock kernel is faster
    assert calls[-1] == (1, 5, 6) and len(calls) == 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.special = nn.modules.linear.NonDynamicallyQuantizableLinear(6, 6)  # a subclass: left alone


def test_patching_only_plain_linears_and_undoing_it():
    net = _Net()
    hooked = lambda x: x  # noqa: E731  (stands in for an accelerate hook's instance-level forward)
    net.b.forward = hooked
    with skinny_linears(net):
        assert "forward" in net.a.__dict__ and net.b.forward is hooked and "forward" not in net.special.__dict__
        with skinny_linears(net):  # nesting keeps the outer patch
            pass
        assert "forward" in net.a.__dict__
        x = torch.randn(3, 6)
        torch.testing.assert_close(net.a(x), F.linear(x, net.a.weight, net.a.bias))
    assert "forward" not in net.a.__dict__ and net.b.forward is hooked
    undo = use_skinny_linears(net)
    assert "forward" in net.a.__dict__
    undo()
    assert "forward" not in net.a.__dict__


def test_greedy_speculative_output_unchanged_under_skinny_linears():
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=3)
    for case, block_size in enumerate((2, 5, 16)):
        drafter = make_drafter(target, seed=case, block_size=block_size)
        prompt = torch.randint(3, 48, (1, 9 + case), generator=torch.Generator().manual_seed(case))
        kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
        expected = target.generate(prompt, **kwargs)
        with skinny_linears(target, drafter):
            assert torch.equal(target.generate(prompt, **kwargs), expected)
            assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), expected)


def test_timed_generate_runs_both_methods_under_skinny_linears():
    from hf_blockpilot.evaluation import timed_generate

    target = make_target("llama", vocab_size=48, hidden_size=64, seed=4)
    drafter = make_drafter(target, block_size=4)
    seen = []
    target.register_forward_pre_hook(lambda module, args: seen.append("forward" in target.lm_head.__dict__))
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(0))
    for assistant in (None, drafter):
        seen.clear()
        timed_generate(target, prompt, assistant, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert seen and all(seen)
    assert "forward" not in target.lm_head.__dict__
