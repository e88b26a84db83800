"""Building the CPU kernels of `hf_blockpilot/kernels/` on the machine that runs them: compiled for this CPU
(`-march=native`) with `torch.utils.cpp_extension` (a C++ compiler and ninja), once per machine, torch version,
source and flags, cached under `$TORCH_EXTENSIONS_DIR` (else `~/.cache/torch_extensions`) in `hf_blockpilot/`."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Seconds a process waits for another process's build of a kernel before it goes on without the kernel.
BUILD_WAIT_S = 900
#: Every build's flags: this CPU's instructions, and no fused multiply-adds the source does not write (the kernels
#: reproduce other kernels' rounding).
BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off")


def _machine_tag(source: Path, flags: Sequence[str]) -> str:
    """What a build depends on (it is compiled for this CPU): CPU model and flags, torch version, source and the
    headers beside it, flags; and where the source lies, as the build files name it: two installs sharing one build
    would rebuild it in turn."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else [platform.processor()]
    cpu = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]  # what the sources include
    text = "\n".join([*cpu, torch.__version__, source.read_text(), *headers, str(source.resolve()), *flags])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_directory(source: Path, flags: Sequence[str] = ()) -> Path:
    """Where this machine's build of `source` with `flags` is made and cached, named by `_machine_tag`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root).expanduser() / "hf_blockpilot" / f"hf_blockpilot_{source.stem}_{_machine_tag(source, flags)}"


def load_kernel(source: Path, flags: Sequence[str] = (), link_flags: Sequence[str] = ()) -> Any | None:
    """The module built from `source` (`BASE_FLAGS` plus `flags`), built here first if not cached yet; `None` where it
    cannot be built (no compiler or ninja, or another process's build did not end within `BUILD_WAIT_S`: said)."""
    from filelock import FileLock
    from torch.utils.cpp_extension import load

    directory = build_directory(source, flags)
    logger.info("hf-blockpilot: loading %s (built once per machine: about a minute)", source.name)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # An OS file lock, released when its process ends, so a build interrupted by a kill cannot leave the next
        # process waiting forever on torch's own lock file (which only its builder removes): holding this lock,
        # a torch lock file left in the directory is such a leftover.
        with FileLock(directory / "hf_blockpilot.lock", timeout=BUILD_WAIT_S):
            (directory / "lock").unlink(missing_ok=True)
            return load(
                name=directory.name,
                sources=[str(source)],
                extra_cflags=[*BASE_FLAGS, *flags],
                extra_ldflags=list(link_flags),
                build_directory=str(directory),
            )
    except Exception as error:  # noqa: BLE001 - any build failure leaves the stock kernels in place
        logger.warning("hf-blockpilot: %s not built (%s); PyTorch's own kernels serve", source.name, error)
        return None
