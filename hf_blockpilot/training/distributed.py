"""Several training processes on torch.distributed, as torchrun starts them:

    torchrun --nproc-per-node 4 -m hf_blockpilot train-drafter ...

A single process (no `WORLD_SIZE` > 1 in the environment) runs as before; these helpers then do nothing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_torchrun() -> None:
    """Join the process group torchrun describes in the environment (`WORLD_SIZE` > 1), once: NCCL on CUDA, each
    rank on its `LOCAL_RANK` GPU, else gloo."""
    if not dist.is_available() or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of processes (0 and 1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def summed_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """`value` summed over every rank (a copy; `value` itself outside a process group)."""
    if rank_and_world_size()[1] == 1:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total


def barrier() -> None:
    """Wait for every rank (nothing outside a process group)."""
    if rank_and_world_size()[1] > 1:
        dist.barrier()
