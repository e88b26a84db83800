"""The exact verify path on CPU: verify forwards round as plain decoding's one-token steps, in every dtype, on
whatever CPU runs the tests (probed, and a simulated kernel that rounds unlike one row is caught), and a call's
path is its own."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target
from torch import nn
from transformers import DynamicCache

from hf_blockpilot import DraftController, attention_kernel, exact_verify
from hf_blockpilot._compat import cache_argument
from hf_blockpilot.exact_verify import ROW_PROBE_LIMIT, row_exact_rows
from hf_blockpilot.row_kernel import exact_row_kernel


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cache_argument_is_the_one_the_installed_transformers_fills_without_deprecation(family):
    target = make_target(family, vocab_size=48, hidden_size=64, seed=1)
    cache = DynamicCache()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)  # 5.24+ deprecates `past_key_values`
        target(torch.randint(3, 48, (1, 7)), **{cache_argument(target): cache})
    assert cache.get_seq_length() == 7  # a name the model ignores would leave it empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_verify_path_makes_a_verify_equal_one_token_steps_bit_for_bit(dtype, family):
    """On every CPU, in every dtype: a verify forward on the exact path gives every row the logits a one-token
    step gives, while the prefill (nothing cached yet) keeps the stock path, as plain decoding's."""
    target = make_target(family, vocab_size=48, hidden_size=64, seed=1).to(dtype)
    gen = torch.Generator().manual_seed(1)
    prompt, block = torch.randint(3, 48, (1, 30), generator=gen), torch.randint(3, 48, (1, 6), generator=gen)
    assert exact_verify.needs_exact_verify(target)
    argument = cache_argument(target)
    with torch.no_grad():
        steps_cache, block_cache = DynamicCache(), DynamicCache()
        target(prompt, **{argument: steps_cache})
        target(prompt, **{argument: block_cache})
        steps = torch.cat([target(block[:, i : i + 1], **{argument: steps_cache}).logits for i in range(6)], 1)
        model = exact_verify.verify_view(target)
        assert model.config._attn_implementation == exact_verify.SLOTWISE_EXACT_ATTENTION
        # linears computed by `row_kernel` where it probes bit-equal to one-row products (bfloat16 on CPUs whose
        # bfloat16 products are dot products, e.g. AVX2 only; float32 where MKL's one-row products take its SSE path)
        linears = [m for m in target.modules() if type(m) is nn.Linear]
        kernel = [m for m in linears if m.bias is None and exact_row_kernel(m.weight) is not None]
        # and the rest split where this CPU's kernels round k rows unlike one (probed, so on every CPU)
        inexact = [m for m in linears if m not in kernel and row_exact_rows(m.weight, m.bias) < ROW_PROBE_LIMIT]
        assert sum("forward" in module.__dict__ for module in model.modules()) == len(inexact) + len(kernel)
        # the call's own view: the shared model is untouched while it runs
        assert target.config._attn_implementation == "sdpa"
        assert not any("forward" in module.__dict__ for module in target.modules())
        with exact_verify.slot_key_lengths([30], [6], masked=False):  # 30 cached, 6 verified
            verified = model(block, **{argument: block_cache}).logits
        prefill = model(prompt).logits  # not a verify forward: the stock path, as plain decoding's prefill
    assert torch.equal(verified, steps)
    with torch.no_grad():
        assert torch.equal(prefill, target(prompt).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_greedy_output_equals_plain_generate_in_each_dtype(dtype):
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=5).to(dtype)
    drafter = make_drafter(target, block_size=6, seed=5, scale=4.0).to(dtype)
    for case in range(6):
        prompt = torch.randint(3, 48, (1, 8 + 5 * case), generator=torch.Generator().manual_seed(case))
        plain = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
        for controller in (DraftController(6), DraftController(3)):
            out = target.generate(
                prompt,
                max_new_tokens=40,
                do_sample=False,
                pad_token_id=0,
                assistant_model=drafter,
                draft_controller=controller,
            )
            assert torch.equal(out, plain), (case, controller.describe())


def test_row_exact_linears_round_every_row_as_it_rounds_alone():
    """A verify multiplies more rows than a plain step; in chunks of at most `row_exact_rows` (probed per shape:
    1 for MKL's float32 GEMM, 33 rows for oneDNN's AMX bfloat16 kernels on some shapes), every row equals its
    one-row product, on whatever kernels this CPU has."""
    from hf_blockpilot.exact_verify import slot_key_lengths, use_row_exact_linears

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Sequential(torch.nn.Linear(1536, 576), torch.nn.Linear(576, 1536)).to(dtype)
        x = torch.randn(100, 1536).to(dtype)
        for layer in model:
            assert 1 <= row_exact_rows(layer.weight, layer.bias) <= ROW_PROBE_LIMIT
        with torch.no_grad():
            hidden = torch.cat([model[0](x[i : i + 1]) for i in range(x.shape[0])])
            alone = torch.cat([model[1](hidden[i : i + 1]) for i in range(x.shape[0])])
        use_row_exact_linears(model, step_rows=1)
        with torch.no_grad(), slot_key_lengths([0], [1], masked=False):  # inside a verify forward
            out = model(x)
        with torch.no_grad():  # outside one (a prefill): the stock product
            assert torch.equal(
                model(x), F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
            )
        assert torch.equal(out, alone), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_single_row_verifies_on_the_exact_path(dtype, monkeypatch):
    """One left-padded row (plain decoding passes its mask) verifies on the call's exact view, slot by slot with
    the row's mask, as a batch does (it once took the stock kernels), and stays plain `generate`'s."""
    import hf_blockpilot.custom_generate as custom_generate_module

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=4).to(dtype)
    drafter = make_drafter(target, block_size=5, seed=4, scale=4.0).to(dtype)
    views = []
    real = custom_generate_module.verify_view

    def recording(*args):
        views.append(real(*args))
        return views[-1]

    monkeypatch.setattr(custom_generate_module, "verify_view", recording)
    accepted = 0
    for case in range(4):
        prompt = torch.randint(3, 48, (1, 6 + 4 * case), generator=torch.Generator().manual_seed(case))
        ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], 1)
        kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
        plain = target.generate(ids, **kwargs)
        out = target.generate(ids, assistant_model=drafter, draft_controller=DraftController(5), **kwargs)
        assert torch.equal(out, plain), case
        assert views[-1] is not target
        assert views[-1].config._attn_implementation == exact_verify.SLOTWISE_EXACT_ATTENTION
        accepted += sum(drafter.last_stats.accepted_per_round)
    assert accepted > 0


def _rounds_unlike_one_row(real: Callable) -> Callable:
    """`F.linear` as a CPU whose several-row kernel rounds unlike its one-row kernel: one ulp up."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = real(x, weight, bias)
        if x.numel() // x.shape[-1] > 1:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out

    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batched", ["real", "one ulp up", "slow"])
def test_a_split_linear_batches_its_products_only_where_that_is_exact_and_faster(monkeypatch, bias, batched):
    """CPU-independent: a linear split into one-row products (a simulated kernel that rounds k rows unlike one)
    computes them in one batched call (`batched_linear`) only where the probe finds that call rounds every product
    as `F.linear` rounds it alone and runs faster; a simulated batched kernel that rounds one ulp up, or one that
    is slow, is caught and the products are computed one by one. Either way every row of a verify equals its
    one-row product."""
    from hf_blockpilot.exact_verify import batched_products_pay, slot_key_lengths, use_row_exact_linears

    monkeypatch.setattr(F, "linear", _rounds_unlike_one_row(F.linear))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    monkeypatch.setattr(exact_verify, "_batched_products_pay", {})
    calls = []
    _recorded_batched_products(
        monkeypatch, calls, rounds_alike=batched != "one ulp up", delay_s=0.02 * (batched == "slow")
    )
    torch.manual_seed(0)
    layer = nn.Linear(96, 64, bias=bias)
    x = torch.randn(1, 7, 96)
    with torch.no_grad():
        alone = torch.cat([F.linear(x[:, i : i + 1], layer.weight, layer.bias) for i in range(7)], dim=1)
        pays = batched_products_pay(layer.weight, layer.bias, 1)
        use_row_exact_linears(layer, step_rows=1)
        calls.clear()
        with slot_key_lengths([0], [7], masked=False):
            out = layer(x)
    assert batched == "real" or not pays  # caught; the real kernels probe as they are on this CPU
    assert calls == ([("baddbmm" if bias else "bmm")] if pays else [])
    assert torch.equal(out, alone)


def _recorded_batched_products(monkeypatch, calls: list, rounds_alike: bool, delay_s: float = 0.0) -> None:
    """`torch.bmm` / `torch.baddbmm` recording their calls; rounding one ulp up unless `rounds_alike`; taking
    `delay_s` longer."""

    def recorded(name: str) -> Callable:
        real = getattr(torch, name)

        def batched(*args, **kwargs):
            calls.append(name)
            time.sleep(delay_s)
            out = real(*args, **kwargs)
            return out if rounds_alike else torch.nextafter(out, torch.full_like(out, float("inf")))

        return batched

    for name in ("bmm", "baddbmm"):
        monkeypatch.setattr(torch, name, recorded(name))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_rounds_alike", [True, False])
def test_one_row_products_are_split_only_where_that_rounds_as_one_row(monkeypatch, bias, split_rounds_alike):
    """CPU-independent: with `one_row_steps="split"`, a one-row input is computed over slices of the weight's outputs in
    one batched call (`split_linear`) only where the probe finds it bit-equal to one-row `F.linear`; a simulated
    batched kernel that rounds one ulp up is caught (no split). Several rows, and views without the switch, keep
    the linear's own forward."""
    from hf_blockpilot.exact_verify import split_parts, use_row_exact_linears

    monkeypatch.setattr(exact_verify, "_split_products_exact", {})
    calls = []
    _recorded_batched_products(monkeypatch, calls, split_rounds_alike)
    torch.manual_seed(0)
    layer = nn.Linear(96, 64, bias=bias)
    plain = nn.Linear(96, 64, bias=bias)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(1, 1, 96)
    with torch.no_grad():
        expected, several = (
            F.linear(x, layer.weight, layer.bias),
            F.linear(x.expand(1, 3, 96), layer.weight, layer.bias),
        )
        parts = split_parts(layer.weight, layer.bias)
        use_row_exact_linears(layer, step_rows=1, one_row_steps="split")
        use_row_exact_linears(plain, step_rows=1)
        calls.clear()
        out, out_several, out_plain = layer(x), layer(x.expand(1, 3, 96)), plain(x)
    assert split_rounds_alike or parts == 1
    assert calls == ([("baddbmm" if bias else "bmm")] if parts > 1 else [])
    assert torch.equal(out, expected) and torch.equal(out_several, several) and torch.equal(out_plain, expected)


@pytest.mark.parametrize("one_row", ["split", "kernel", "stock"])
def test_a_request_whose_steps_take_faster_products_stays_plain_generates(monkeypatch, one_row):
    """A single request's plain steps run on the call's view, with split or kernel one-row products where the
    calibration timed them faster (`CostModel.one_row_steps`), and greedy output stays plain `generate`'s, whether it
    drafts or steps plain."""
    import hf_blockpilot.custom_generate as custom_generate_module
    from hf_blockpilot.controllers import SpeculationGuard
    from hf_blockpilot.costs import CostModel

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=5)
    drafter = make_drafter(target, block_size=4, seed=5, scale=4.0)
    views = []
    real = custom_generate_module.verify_view

    def recording(*args):
        views.append(args)
        return real(*args)

    monkeypatch.setattr(custom_generate_module, "verify_view", recording)
    on_stock = []
    target.register_forward_hook(lambda module, *args: on_stock.append(module is target))  # views copy the hook
    for case, step_ms in enumerate((10.0, 1.0, 10.0, 1.0)):  # 1 ms steps: drafting cannot pay, the guard steps plain
        prompt = torch.randint(3, 48, (1, 5 + 4 * case), generator=torch.Generator().manual_seed(case))
        kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
        plain = target.generate(prompt, **kwargs)
        controller = SpeculationGuard(DraftController(4))
        controller.use_cost_model(
            CostModel(target_ms={1: step_ms, 4: 12.0}, drafter_ms={4: 1.0}, one_row_steps=one_row)
        )
        on_stock.clear()
        out = target.generate(prompt, assistant_model=drafter, draft_controller=controller, **kwargs)
        assert torch.equal(out, plain), case
        assert views[-1][2] == one_row
        if step_ms == 1.0:  # plain steps only
            assert drafter.last_stats.drafter_forwards == 0
            assert not any(on_stock[1:])  # after the prefill: the view's steps, never the stock model's


def test_the_row_probe_catches_several_rows_summed_in_another_order_that_random_inputs_miss(monkeypatch):
    """CPU-independent: a simulated `F.linear` whose products of several rows sum at a higher precision than one
    row's agrees with one-row products on random inputs nearly always (an AMX Xeon's 64 x 64 bfloat16 products did
    on every random probe); `row_exact_rows` still finds it rounds two rows unlike one."""
    real = F.linear

    def linear(x, weight, bias=None):
        if x.numel() == x.shape[-1]:
            return real(x, weight, bias)
        exact = real(x.double(), weight.double(), None if bias is None else bias.double())
        return exact.to(x.dtype)

    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alone = torch.cat([real(row[None], weight) for row in x])
    assert (linear(x, weight) == alone).float().mean() > 0.99
    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    assert exact_verify.row_exact_rows(weight) == 1


def test_probes_catch_a_linear_that_rounds_differently_for_several_rows(monkeypatch):
    """CPU-independent: a simulated kernel that rounds k rows unlike one is caught by the per-weight probe and by
    calibration's verify probe, the exact path repairs it, and greedy speculative output stays plain's."""
    from hf_blockpilot.device_calibration import probe_exact_verify

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=2)
    drafter = make_drafter(target, block_size=5, seed=2, scale=4.0)
    monkeypatch.setattr(F, "linear", _rounds_unlike_one_row(F.linear))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    assert exact_verify.row_exact_rows(target.model.layers[0].mlp.down_proj.weight) == 1
    assert probe_exact_verify(target, [2, 4, 5]) == []  # the exact path splits every verify into single rows
    monkeypatch.setattr(exact_verify, "needs_exact_verify", lambda model: False)
    assert probe_exact_verify(target, [2, 4, 5]) == [2, 4, 5]  # the stock kernels: caught
    monkeypatch.undo()
    monkeypatch.setattr(F, "linear", _rounds_unlike_one_row(F.linear))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    for case in range(4):
        prompt = torch.randint(3, 48, (1, 6 + 3 * case), generator=torch.Generator().manual_seed(case))
        kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
        plain = target.generate(prompt, **kwargs)
        out = target.generate(prompt, assistant_model=drafter, draft_controller=DraftController(5), **kwargs)
        assert torch.equal(out, plain), case


def test_a_calls_exact_path_is_its_own_while_another_thread_decodes_plain_on_the_same_model():
    """Two threads share one model object: one decodes plain, one speculatively on the exact verify path (its
    attention implementation switched and its linears split, in the call's view), 50 times each. Each output
    equals its single-thread output every time, and the plain thread never sees the shared model changed: the
    path lives in the speculative call's own view of the model."""
    import threading

    from hf_blockpilot import AdaptiveVerify, CostModel

    target = make_target("llama", vocab_size=48, hidden_size=64, seed=7)
    drafter = make_drafter(target, block_size=6, seed=7, scale=4.0)
    kernels = CostModel(target_ms={1: 1.0, 8: 1.0}, drafter_ms={8: 0.1})
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(7))

    def plain() -> torch.Tensor:
        return target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)

    def speculative() -> torch.Tensor:
        controller = AdaptiveVerify(6, cost_model=kernels)
        return target.generate(
            prompt,
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
            assistant_model=drafter,
            draft_controller=controller,
        )

    hooks = sum(len(module._forward_hooks) for module in target.modules())
    expected = {"plain": plain(), "speculative": speculative()}
    problems: list[str] = []

    def run(name: str, decode: Callable[[], torch.Tensor]) -> None:
        for i in range(50):
            if not torch.equal(decode(), expected[name]):
                problems.append(f"{name} output {i} differs")
            if name == "plain" and (
                target.config._attn_implementation != "sdpa"
                or any("forward" in module.__dict__ for module in target.modules())
                or drafter.last_stats is not None  # per thread: the other thread's calls never show here
            ):
                problems.append(f"the plain thread saw the shared model changed ({i})")
            if name == "speculative" and drafter.last_stats.new_tokens != expected[name].shape[1] - prompt.shape[1]:
                problems.append(f"the speculative thread's stats are not its call's ({i})")

    threads = [threading.Thread(target=run, args=item) for item in (("plain", plain), ("speculative", speculative))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert problems == []
    # what Transformers attaches during a call (the hooks that capture the drafter's hidden states) stayed in it
    assert sum(len(module._forward_hooks) for module in target.modules()) == hooks


class _Attention(nn.Module):
    """What `slotwise_exact_attention` reads of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
def test_a_padded_batchs_slots_in_one_loop_give_each_slots_own_sdpa_call(monkeypatch, dtype, groups):
    """A masked verify over ragged rows computes every slot in one C++ loop (`slot_calls`) where that probes exact:
    each slot equals its own SDPA call over the keys plain decoding holds then (the Python loop's result, switched
    off with `HF_BLOCKPILOT_SLOT_CALLS=0`); padding slots stay zero."""
    generator = torch.Generator().manual_seed(groups)
    heads, head_dim, lengths, slots = 6, 32, [9, 30, 17], [3, 1, 2]
    width = max(slots)
    query = torch.randn(3, heads, width, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(3, heads // groups, 40, head_dim, generator=generator).to(dtype) for _ in "kv")
    last = torch.tensor(lengths)[:, None] + torch.arange(width)  # the last key each row's slot i attends to
    positions = torch.arange(40)[None, None, None, :]
    mask = (positions <= last[:, None, :, None]) & (positions >= torch.tensor([2, 0, 5])[:, None, None, None])
    module = _Attention(groups)

    def attend() -> torch.Tensor:
        exact_verify._slot_calls_match.clear()
        with exact_verify.slot_key_lengths(lengths, slots, masked=True):
            return exact_verify.slotwise_exact_attention(module, query, key, value, mask)[0]

    looped = attend()
    if exact_verify.slot_calls() is None or not exact_verify.slot_calls_match_sdpa(dtype, heads, groups, head_dim):
        pytest.skip("the slot-call loop is not built here (no compiler)")
    monkeypatch.setenv("HF_BLOCKPILOT_SLOT_CALLS", "0")
    exact_verify.slot_calls.cache_clear()
    try:
        assert exact_verify.slot_calls() is None
        in_python = attend()
    finally:
        exact_verify.slot_calls.cache_clear()
    assert torch.equal(looped, in_python)
    for r, (length, count) in enumerate(zip(lengths, slots, strict=True)):
        assert not looped[r, count:].any()
        for i in range(count):
            one = query[r : r + 1, :, i : i + 1].reshape(1, heads // groups, groups, head_dim)
            keys = slice(0, length + i + 1)
            sdpa = F.scaled_dot_product_attention(
                one, key[r : r + 1, :, keys], value[r : r + 1, :, keys], attn_mask=mask[r : r + 1, :, i : i + 1, keys]
            )
            assert torch.equal(looped[r, i], sdpa.reshape(heads, -1))


def test_the_slot_call_loop_is_refused_where_it_rounds_unlike_sdpa(monkeypatch):
    """CPU-independent: a loop that gives one output one ulp off is refused by the probe, and the slots are then
    computed one SDPA call each."""

    class OneUlpOff:
        @staticmethod
        def masked_slot_calls(q, k, v, mask, lengths, slots, scale, groups):
            out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=q.dtype)
            for r, (length, count) in enumerate(zip(lengths, slots, strict=True)):
                for i in range(count):
                    one = q[r : r + 1, :, i : i + 1].reshape(1, q.shape[1] // groups, groups, -1)
                    keys = slice(0, length + i + 1)
                    m = mask[r : r + 1, :, i : i + 1, keys]
                    sdpa = F.scaled_dot_product_attention(one, k[r : r + 1, :, keys], v[r : r + 1, :, keys], m)
                    out[r, i] = sdpa.reshape(q.shape[1], -1)
            out.view(torch.int16)[..., -1] += 1
            return out

    monkeypatch.setattr(exact_verify, "slot_calls", lambda: OneUlpOff)
    monkeypatch.setattr(exact_verify, "_slot_calls_match", {})
    assert not exact_verify.slot_calls_match_sdpa(torch.bfloat16, 4, 2, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_calls_attention_kernels_are_built_and_probed_before_it_decodes(monkeypatch, batch_size, dtype):
    """The view a call verifies with has probed (built first, where a compiler is) the attention kernels its forwards
    may take for the target's head layout, so no one-time build or probe lands inside a round (the speculation
    guard times rounds)."""
    monkeypatch.setattr(attention_kernel, "_exact_parts", {})
    monkeypatch.setattr(exact_verify, "_slot_calls_match", {})
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=1).to(dtype)
    config = target.config
    exact_verify.verify_view(target, batch_size)
    layout = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if batch_size == 1:
        assert list(attention_kernel._exact_parts) == [(dtype, *layout, torch.get_num_threads())]
        assert not exact_verify._slot_calls_match
    else:
        groups = layout[0] // layout[1]
        assert list(exact_verify._slot_calls_match) == [(dtype, layout[0], groups, layout[2])]
        assert not attention_kernel._exact_parts
