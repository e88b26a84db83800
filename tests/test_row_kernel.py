"""The bfloat16 verify kernel: used only where it probes bit-equal to one-row products (a simulated kernel that
rounds one output differently is refused, on any CPU), and where this machine builds it, every row of its products
equals the row's one-row `F.linear`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_blockpilot import exact_verify, row_kernel
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

    def install(kernel):
        monkeypatch.setattr(row_kernel, "row_kernel", lambda: kernel)
        monkeypatch.setattr(exact_verify, "row_kernel", lambda: kernel)
        monkeypatch.setattr(row_kernel, "_rounds_as_one_row", {})

    return install


def test_the_probe_refuses_a_kernel_that_rounds_one_output_unlike_one_row(simulated_kernel):
    weight = torch.randn(40, 24).to(torch.bfloat16)
    simulated_kernel(_one_ulp_off)
    assert not row_kernel.rounds_as_one_row(weight)
    simulated_kernel(_one_row_products)
    assert row_kernel.rounds_as_one_row(weight)
    assert not row_kernel.rounds_as_one_row(weight.float())  # bfloat16 only
    simulated_kernel(None)  # not built here
    assert not row_kernel.rounds_as_one_row(weight)


def test_verify_forwards_use_the_kernel_where_it_probes_exact_and_only_there(simulated_kernel):
    calls = []

    def counted(x, weight):
        calls.append(x.shape[0])
        return _one_row_products(x, weight)

    simulated_kernel(counted)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16)).to(torch.bfloat16)
    x = torch.randn(2, 5, 32).to(torch.bfloat16)
    with torch.no_grad():
        stock = model(x)
        exact = exact_verify.row_exact_rows(model[0].weight) == exact_verify.ROW_PROBE_LIMIT
        use_row_exact_linears(model, step_rows=1)
        calls.clear()
        assert torch.equal(model(x), stock)  # outside a verify forward (a prefill): the stock products
        assert calls == []
        with slot_key_lengths([0, 0], [5, 5], masked=False):
            verified = model(x)
    assert torch.equal(verified, torch.cat([model(x[:, i : i + 1]) for i in range(5)], 1))
    # the bias-free linear goes through the kernel (10 rows at once) where its stock products round every row alike;
    # the linear with a bias never does
    assert calls == ([10] if exact else [])


def test_the_built_kernel_rounds_every_row_as_one_row_on_this_machine():
    kernel = row_kernel.row_kernel()
    weight = torch.randn(576, 200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if kernel is None or not row_kernel.rounds_as_one_row(weight):
        pytest.skip(f"no row kernel for this CPU ({torch.backends.cpu.get_cpu_capability()}) or build")
    generator = torch.Generator().manual_seed(4)
    for scale in (0.01, 1.0, 100.0):
        x = (scale * torch.randn(17, 200, generator=generator)).to(torch.bfloat16)
        assert torch.equal(kernel(x, weight), _one_row_products(x, weight)), scale


def test_the_kernel_is_switched_off_by_its_environment_variable(monkeypatch):
    monkeypatch.setenv(row_kernel.SWITCH, "0")
    row_kernel.extension.cache_clear()
    try:
        assert row_kernel.extension() is None
        assert row_kernel.row_kernel() is None
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
    directory = row_kernel.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    assert directory.is_relative_to(tmp_path)
    assert row_kernel.extension() == "built"
    assert fake_build == [False]


def test_a_build_held_by_another_process_too_long_leaves_the_stock_products(fake_build, monkeypatch, caplog):
    from filelock import FileLock

    directory = row_kernel.build_directory()
    directory.mkdir(parents=True)
    monkeypatch.setattr(row_kernel, "BUILD_WAIT_S", 0.2)
    with FileLock(directory / "hf_blockpilot.lock"):  # another builder, still at work
        assert row_kernel.extension() is None
    assert fake_build == []
    assert "not built" in caplog.text
