"""The verify kernels (bfloat16 and float32): used only where they probe bit-equal to one-row products (a simulated
kernel that rounds one output differently is refused, on any CPU), and where this machine builds them, every row of
their products equals the row's one-row `F.linear`."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_blockpilot import exact_verify, kernel_build, row_kernel
from hf_blockpilot.exact_verify import slot_key_lengths, use_row_exact_linears


def _one_row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x[r : r + 1], weight) for r in range(x.shape[0])])


def _one_ulp_off(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = _one_row_products(x, weight)
    out.view(torch.int16)[-1, -1] += 1  # the next bfloat16 away from zero
    return out


@pytest.fixture
def simulated_kernel(monkeypatch):
    """Install `kernel` as this process's row kernel, with the probe's results forgotten (before and after)."""

    def install(*kernels):
        monkeypatch.setattr(row_kernel, "row_kernels", lambda dtype: [k for k in kernels if k is not None])
        monkeypatch.setattr(row_kernel, "_exact_row_kernels", {})
        monkeypatch.setattr(exact_verify, "_kernel_pays", {})

    return install


def test_the_probe_refuses_a_kernel_that_rounds_one_output_unlike_one_row(simulated_kernel):
    weight = torch.randn(40, 24).to(torch.bfloat16)
    simulated_kernel(_one_ulp_off)
    assert row_kernel.exact_row_kernel(weight) is None
    simulated_kernel(_one_row_products)
    assert row_kernel.exact_row_kernel(weight) is _one_row_products
    assert row_kernel.exact_row_kernel(weight.t()) is None  # a contiguous weight only
    simulated_kernel(None)  # not built here
    assert row_kernel.exact_row_kernel(weight) is None


def _linear_rounding_four_rows_otherwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear`, but a product of 4 or more rows rounds its last output one bfloat16 away from zero."""
    out = F.linear(x, weight)
    if x.shape[0] >= 4:
        out.view(torch.int16)[:, -1] += 1
    return out


def test_the_probe_takes_the_first_kernel_that_rounds_as_a_product_of_the_steps_rows(simulated_kernel, monkeypatch):
    """CPU-independent: a batch's step is one product of its rows, which some kernels round unlike one row (oneDNN's
    bfloat16 products of 4+ rows sum the inputs in blocks of 1024, one row in blocks of 512); of several candidate
    kernels the probe takes the first that gives what a product of that many rows gives, per row count."""
    monkeypatch.setattr(row_kernel, "F", SimpleNamespace(linear=_linear_rounding_four_rows_otherwise))
    weight = torch.randn(40, 24).to(torch.bfloat16)

    def as_four(x, weight):
        return torch.cat([_linear_rounding_four_rows_otherwise(part, weight) for part in x.split(4)])

    simulated_kernel(_one_ulp_off, _one_row_products, as_four)
    assert row_kernel.exact_row_kernel(weight, rows=1) is _one_row_products
    assert row_kernel.exact_row_kernel(weight, rows=4) is as_four
    simulated_kernel(_one_ulp_off, _one_row_products)
    assert row_kernel.exact_row_kernel(weight, rows=4) is None


def _summed_in_float32_in_order(x: torch.Tensor, weight: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """A product whose every output sums its float32 products one by one, in input order (or reversed)."""
    products = x.float()[:, None, :] * weight.float()[None]
    total = products.new_zeros(products.shape[:2])
    for j in reversed(range(products.shape[-1])) if reverse else range(products.shape[-1]):
        total = total + products[..., j]
    return total.to(x.dtype)


def _summed_exactly(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(x.dtype)


def test_the_order_probe_refuses_kernels_that_agree_on_random_inputs_but_sum_otherwise(simulated_kernel, monkeypatch):
    """CPU-independent: against a product that sums in float32 in input order, a kernel summing at a higher precision
    or in the reverse order agrees on nearly every random bfloat16 output (an AMX Xeon's products and the native
    bfloat16 kernel differed on 1 of 768 outputs of a real forward), yet the probe refuses both and takes the kernel
    that sums in the same order."""
    monkeypatch.setattr(row_kernel, "F", SimpleNamespace(linear=_summed_in_float32_in_order))
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    reverse = functools.partial(_summed_in_float32_in_order, reverse=True)
    for other in (_summed_exactly, reverse):
        assert (other(x, weight) == _summed_in_float32_in_order(x, weight)).float().mean() > 0.99
    simulated_kernel(_summed_exactly, reverse, _summed_in_float32_in_order)
    assert row_kernel.exact_row_kernel(weight) is _summed_in_float32_in_order
    simulated_kernel(_summed_exactly, reverse)
    assert row_kernel.exact_row_kernel(weight) is None


def test_the_order_probes_weight_is_aligned_as_the_real_one():
    generator = torch.Generator().manual_seed(0)
    for dtype, offset in [(torch.float32, 0), (torch.float32, 3), (torch.bfloat16, 5)]:
        weight = torch.zeros(40 * 24 + offset, dtype=dtype)[offset:].view(40, 24)
        x, probe_weight = row_kernel.order_probe(weight, 8, generator)
        assert probe_weight.data_ptr() % 64 == weight.data_ptr() % 64 and probe_weight.shape == weight.shape
        assert probe_weight.dtype == x.dtype == dtype and x.shape == (8, 24)
        scale = row_kernel.ORDER_PROBE_SCALE  # at up to three inputs a row; products +-2^24 and 1, exact in `dtype`
        assert set((probe_weight.float().sum(1) / scale).tolist()) <= {1.0, 2.0, 3.0}
        assert set((x.float()[:, None] * probe_weight.float()[None]).unique().tolist()) <= {
            -(2.0**24),
            0.0,
            1.0,
            2.0**24,
        }
    weight = torch.zeros(40, 24, dtype=torch.float16)  # +-2^24 is no float16, yet each factor is
    x, probe_weight = row_kernel.order_probe(weight, 8, generator)
    assert torch.isfinite(x).all() and torch.isfinite(probe_weight).all()


def test_no_kernel_for_other_dtypes_nor_for_float32_summed_in_another_order(monkeypatch):
    def no_build():
        raise AssertionError("built")

    monkeypatch.setattr(row_kernel, "extension", no_build)
    assert row_kernel.row_kernels(torch.float16) == []
    monkeypatch.setattr(row_kernel, "one_row_float32_in_sse_order", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert row_kernel.row_kernels(torch.float32) == []  # nothing built where MKL sums otherwise and no AVX-512
    built = SimpleNamespace(f32_rows="sse", f32_rows16="avx512", has_f32_rows16=lambda: True)
    monkeypatch.setattr(row_kernel, "extension", lambda: built)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert row_kernel.row_kernels(torch.float32) == ["avx512"]  # MKL's AVX-512 order, left to the probes
    monkeypatch.setattr(row_kernel, "one_row_float32_in_sse_order", lambda: True)
    assert row_kernel.row_kernels(torch.float32) == ["sse", "avx512"]


def _sizes_of_the_sums_holding_input_0_and(kernel, inputs: int, offset: int = 0) -> list[int]:
    """For each j >= 1: how many inputs the smallest partial sum holding inputs 0 and j holds (FPRev: a weight of
    ones, +M at input 0 and -M at j, M = 2^40 absorbs every one added to a sum holding only one of them)."""
    sizes = []
    weight = torch.ones(8 * inputs + offset)[offset:].view(8, inputs)
    for j in range(1, inputs):
        x = torch.ones(1, inputs)
        x[0, 0], x[0, j] = 2.0**40, -(2.0**40)
        sizes.append(int(inputs - kernel(x, weight)[0, 0]))
    return sizes


def test_the_avx512_float32_kernel_sums_in_its_documented_order():
    """`f32_rows16` as `kernels/linear_rows.cpp` documents it, whatever MKL does here: input 0 seeds lane 0, inputs
    1.. go to lane (j - 1) % 16, lanes summed by halves, the 15 inputs past the last whole vector (j >= 49 of 64)
    in a vector of their own seeded with that sum."""
    module = row_kernel.extension()
    if module is None or not module.has_f32_rows16():
        pytest.skip(f"no AVX-512 float32 row kernel for this CPU ({torch.backends.cpu.get_cpu_capability()})")

    def lanes_joined(lane: int) -> int:  # lanes of the halves-tree node joining lanes 0 and `lane` > 0
        return 16 // (lane & -lane)  # (l, l + 8) join first: 2 lanes; then (l, l + 4): 4; (l, l + 2): 8; all 16

    # inputs 1..48: 3 whole vectors, 3 inputs a lane (lane 0: input 0 first, then 1, 17, 33)
    expected = [2 + (j - 1) // 16 if (j - 1) % 16 == 0 else 1 + 3 * lanes_joined((j - 1) % 16) for j in range(1, 49)]
    # inputs 49..63: one input a lane (15 lanes), lane 0 seeded with the first 49 inputs' sum
    expected += [50 if j == 49 else 49 + min(lanes_joined(j - 49), 15) for j in range(49, 64)]
    for offset in (0, 1, 3):  # unlike MKL's SSE path, not by the weight's alignment
        assert _sizes_of_the_sums_holding_input_0_and(module.f32_rows16, 64, offset) == expected


@pytest.mark.parametrize("peel", [1, 2, 3, 4])
def test_the_sse_order_emulation_sums_in_the_documented_order(peel):
    generator = torch.Generator().manual_seed(peel)
    products = torch.randn(16, 23, generator=generator) * 2.0 ** torch.randint(-20, 20, (16, 23), generator=generator)
    expected = []
    for row in products.numpy():  # one float32 operation at a time, as `kernels/linear_rows.cpp` documents
        lanes = [np.float32(0)] * 4
        for j in range(peel):
            lanes[0] = np.float32(lanes[0] + row[j])
        vectors = (23 - peel) // 4
        for j in range(peel, peel + 4 * vectors):
            lanes[(j - peel) % 4] = np.float32(lanes[(j - peel) % 4] + row[j])
        total = np.float32(np.float32(lanes[0] + lanes[2]) + np.float32(lanes[1] + lanes[3]))
        for j in range(peel + 4 * vectors, 23):
            total = np.float32(total + row[j])
        expected.append(total)
    assert torch.equal(row_kernel._sums_in_sse_order(products, peel), torch.tensor(expected))
    left_to_right = torch.tensor([functools.reduce(lambda a, b: np.float32(a + b), row) for row in products.numpy()])
    assert not torch.equal(torch.tensor(expected), left_to_right)  # these sums tell the orders apart


def test_verify_forwards_use_the_kernel_where_it_probes_exact_and_only_there(simulated_kernel, monkeypatch):
    calls = []

    def counted(x, weight):
        calls.append(x.shape[0])
        return _one_row_products(x, weight)

    simulated_kernel(counted)
    monkeypatch.setattr(exact_verify, "kernel_pays", lambda *timed: True)  # timed below
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16)).to(torch.bfloat16)
    x = torch.randn(2, 5, 32).to(torch.bfloat16)
    with torch.no_grad():
        stock = model(x)
        use_row_exact_linears(model, step_rows=1)
        calls.clear()
        assert torch.equal(model(x), stock)  # outside a verify forward (a prefill): the stock products
        assert calls == []
        with slot_key_lengths([0, 0], [5, 5], masked=False):
            verified = model(x)
    assert torch.equal(verified, torch.cat([model(x[:, i : i + 1]) for i in range(5)], 1))
    # the bias-free linear goes through the kernel (10 rows at once); the linear with a bias never does
    assert calls == [10]


def test_a_verify_takes_the_kernel_only_where_it_is_faster_than_the_stock_products(simulated_kernel):
    """CPU-independent: a kernel slower than the stock products (a native bfloat16 product that rounds every row
    alike) is left out; one faster than them, or than the products of one row each that the exact path would run
    where several rows round otherwise, is taken."""
    import time

    weight = torch.randn(64, 256).to(torch.bfloat16)
    rows = torch.zeros(exact_verify.KERNEL_TIMING_ROWS, 64).to(torch.bfloat16)

    def slow(x, weight):
        time.sleep(0.002)
        return rows

    def fast(x, weight):  # nothing to compute: faster than any product
        return rows

    for product_rows in (128, 1):
        assert not exact_verify.kernel_pays(weight, slow, step_rows=1, product_rows=product_rows)
        assert exact_verify.kernel_pays(weight, fast, step_rows=2, product_rows=product_rows)


@pytest.mark.parametrize("exact", [True, False])
def test_one_row_steps_take_the_kernel_only_where_it_probes_exact(simulated_kernel, exact):
    """CPU-independent: with `one_row_steps="kernel"`, a one-row input of a bias-free linear, outside verify
    forwards too (a plain step), goes through the kernel where it probes bit-equal, and nowhere else (a simulated
    kernel one ulp off is refused: the stock product); several rows and a linear with a bias keep their forwards."""
    calls = []

    def counted(x, weight):
        calls.append(x.shape[0])
        return (_one_row_products if exact else _one_ulp_off)(x, weight)

    simulated_kernel(counted)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16)).to(torch.bfloat16)
    one, several = torch.randn(1, 1, 32).to(torch.bfloat16), torch.randn(1, 3, 32).to(torch.bfloat16)
    with torch.no_grad():
        expected = model(one), model(several)
        use_row_exact_linears(model, step_rows=1, one_row_steps="kernel")
        calls.clear()
        out = model(one), model(several)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert calls == ([1] if exact else [])
    with pytest.raises(ValueError, match="one of the ways"):  # a fresh model: `model`'s linears now have forwards
        use_row_exact_linears(nn.Linear(32, 48, bias=False), step_rows=1, one_row_steps="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 1, 3])  # a float32 weight row's address decides MKL's summation order
def test_the_built_kernel_rounds_every_row_as_one_row_on_this_machine(dtype, offset):
    storage = torch.randn(576 * 200 + offset, generator=torch.Generator().manual_seed(3)).to(dtype)
    weight = storage[offset:].view(576, 200)
    kernel = row_kernel.exact_row_kernel(weight)
    if kernel is None:
        pytest.skip(f"no {dtype} row kernel for this CPU ({torch.backends.cpu.get_cpu_capability()}) or build")
    generator = torch.Generator().manual_seed(4)
    for scale in (0.01, 1.0, 100.0):
        x = (scale * torch.randn(17, 200, generator=generator)).to(dtype)
        assert torch.equal(kernel(x, weight), _one_row_products(x, weight)), scale


def test_the_kernel_is_switched_off_by_its_environment_variable(monkeypatch):
    monkeypatch.setenv(row_kernel.SWITCH, "0")
    row_kernel.extension.cache_clear()
    try:
        assert row_kernel.extension() is None
        assert row_kernel.row_kernels(torch.bfloat16) == [] and row_kernel.row_kernels(torch.float32) == []
    finally:
        row_kernel.extension.cache_clear()


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """`extension()` against a fake `torch.utils.cpp_extension.load` that records whether torch's lock file was
    present when it ran, builds in `tmp_path`, and is forgotten before and after."""
    import torch.utils.cpp_extension

    seen = []

    def load(name, build_directory, **kwargs):
        seen.append(Path(build_directory, "lock").exists())
        return "built"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(row_kernel.SWITCH, raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    row_kernel.extension.cache_clear()
    yield seen
    row_kernel.extension.cache_clear()


def test_a_build_interrupted_by_a_kill_does_not_block_the_next(fake_build, tmp_path):
    # torch's own lock file, left behind by a builder that was killed, would make torch wait for it forever
    directory = kernel_build.build_directory(row_kernel.SOURCE, row_kernel.FLAGS)
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    assert directory.is_relative_to(tmp_path)
    assert row_kernel.extension() == "built"
    assert fake_build == [False]


def test_a_build_held_by_another_process_too_long_leaves_the_stock_products(fake_build, monkeypatch, caplog):
    from filelock import FileLock

    directory = kernel_build.build_directory(row_kernel.SOURCE, row_kernel.FLAGS)
    directory.mkdir(parents=True)
    monkeypatch.setattr(kernel_build, "BUILD_WAIT_S", 0.2)
    with FileLock(directory / "hf_blockpilot.lock"):  # another builder, still at work
        assert row_kernel.extension() is None
    assert fake_build == []
    assert "not built" in caplog.text


def test_two_installs_of_one_source_build_apart(tmp_path, monkeypatch):
    """Torch's build files name the source's path, so two installs (a checkout and a CI clone, two virtual environments)
    sharing one build directory would rebuild it in turn: each gets its own; the same install, the same one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    copies = []
    for install in ("a", "b"):
        (tmp_path / install).mkdir()
        copies.append(tmp_path / install / row_kernel.SOURCE.name)
        copies[-1].write_text(row_kernel.SOURCE.read_text())
    first, second = (kernel_build.build_directory(copy, row_kernel.FLAGS) for copy in copies)
    assert first != second and first.parent == second.parent
    assert kernel_build.build_directory(copies[0], row_kernel.FLAGS) == first
