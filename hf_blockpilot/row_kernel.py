"""A CPU kernel for verify forwards in bfloat16: k rows in one pass over the weight, each row rounded exactly as
PyTorch's one-row product rounds it.

On CPUs without bfloat16 matrix instructions PyTorch computes a bfloat16 product of k rows as k one-row dot-product
passes, so a k-token verify costs nearly k plain steps. `kernels/bf16_rows.cpp` does each row's operations in the
same order but converts the weight once for all rows. It is built at first use (a C++ compiler and ninja, with
`torch.utils.cpp_extension`, cached per machine and torch version) and used for a weight only where it probes
bit-equal to one-row `F.linear` (`rounds_as_one_row`); everywhere else, or with `HF_BLOCKPILOT_ROW_KERNEL=0`, the
stock products serve. docs/exactness.md has the measurements.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "bf16_rows.cpp"
#: Set to "0" to never build or use the kernel.
SWITCH = "HF_BLOCKPILOT_ROW_KERNEL"
#: The float lanes of PyTorch's vectors per CPU capability: the accumulator layout the kernel reproduces. Only
#: AVX2 is listed: the AVX-512 CPUs seen multiply bfloat16 with oneDNN (native instructions), which this kernel
#: does not reproduce, so building it there would be wasted.
LANE_WIDTHS = {"AVX2": 8}
#: Seconds a process waits for another process's build of the kernel before it goes on without the kernel.
BUILD_WAIT_S = 900
#: Rows of the probe's inputs: one-row products to compare against, at three input scales.
PROBE_ROWS = (8, 8, 8, 32)

RowKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_rounds_as_one_row: dict[tuple, bool] = {}


def _machine_tag() -> str:
    """What a build depends on (it is compiled for this CPU): CPU model and flags, torch version, the source."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else [platform.processor()]
    cpu = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    text = "\n".join([*cpu, torch.__version__, SOURCE.read_text()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_directory() -> Path:
    """Where this machine's build of the kernel is made and cached, named by `_machine_tag`: under
    `$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions` (where `torch.utils.cpp_extension` keeps its builds),
    in `hf_blockpilot/`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root).expanduser() / "hf_blockpilot" / f"hf_blockpilot_bf16_rows_{_machine_tag()}"


@functools.cache
def extension() -> Any | None:
    """The built `kernels/bf16_rows.cpp` module (`linear_rows(x, weight, lane_width)`), cached per process; `None`
    where it is switched off or cannot be built (no compiler or ninja, or another process's build did not end
    within `BUILD_WAIT_S`: said once)."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    from filelock import FileLock
    from torch.utils.cpp_extension import load

    directory = build_directory()
    logger.info("hf-blockpilot: loading its bfloat16 verify kernel (built once per machine: about a minute)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # An OS file lock, released when its process ends, so a build interrupted by a kill cannot leave the next
        # process waiting forever on torch's own lock file (which only its builder removes): holding this lock,
        # a torch lock file left in the directory is such a leftover.
        with FileLock(directory / "hf_blockpilot.lock", timeout=BUILD_WAIT_S):
            (directory / "lock").unlink(missing_ok=True)
            return load(
                name=directory.name,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
    except Exception as error:  # noqa: BLE001 - any build failure leaves the stock products in place
        logger.warning("hf-blockpilot: bfloat16 verify kernel not built (%s); verifies use PyTorch's products", error)
        return None


def row_kernel() -> RowKernel | None:
    """`kernel(x (rows, in), weight (out, in))` -> (rows, out), both bfloat16, with this CPU's lane layout; `None`
    where PyTorch's CPU capability has no known lane layout or `extension` is not available."""
    width = LANE_WIDTHS.get(torch.backends.cpu.get_cpu_capability())
    module = extension() if width is not None else None
    return None if module is None else lambda x, weight: module.linear_rows(x, weight, width)


def rounds_as_one_row(weight: torch.Tensor) -> bool:
    """Whether `row_kernel` gives every row of a product with `weight` (bias-free) exactly what one-row
    `F.linear` gives it, probed once per shape on inputs at three scales. False for anything but a 2-D bfloat16
    CPU weight, and where the kernel is not available."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type)
    if key not in _rounds_as_one_row:
        eligible = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
        kernel = row_kernel() if eligible else None
        exact = kernel is not None
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, rows in enumerate(PROBE_ROWS if exact else ()):
                x = (8.0 ** (i % 3 - 1) * torch.randn(rows, weight.shape[1], generator=generator)).to(weight)
                alone = torch.cat([F.linear(x[r : r + 1], weight) for r in range(rows)])
                if not torch.equal(kernel(x, weight), alone):
                    exact = False
                    break
        _rounds_as_one_row[key] = exact
    return _rounds_as_one_row[key]
