"""Several training processes on torch.distributed, as torchrun starts them:

    torchrun --nproc-per-node 4 -m hf_blockpilot train-drafter ...

A single process (no `WORLD_SIZE` > 1 in the environment) runs as before; these helpers then do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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


def on_any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (so that every rank takes the same branch around a collective)."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"  # reduces GPU tensors only
    return bool(summed_over_ranks(torch.tensor([int(flag)], device="cuda" if nccl else "cpu")).item())


#: How long a rank waits at `barrier` for the others: data preparation (answers, hidden states) may take hours and
#: finish at different times on different ranks, past the backends' default timeouts (10-30 minutes).
BARRIER_TIMEOUT = timedelta(days=2)
_barrier_groups: dict = {}  # default process group -> its gloo group for `barrier`


def barrier() -> None:
    """Wait for every rank (nothing outside a process group), however long the slowest takes (`BARRIER_TIMEOUT`),
    on a gloo group of its own, so that the training collectives keep their backend's timeout."""
    if rank_and_world_size()[1] == 1:
        return
    default = dist.group.WORLD
    if default not in _barrier_groups:
        _barrier_groups[default] = dist.new_group(backend="gloo", timeout=BARRIER_TIMEOUT)
    dist.barrier(group=_barrier_groups[default])


def shard(layers: Iterable[nn.Module], root: nn.Module | None = None) -> None:
    """FSDP2: each of `layers`, then the rest of `root` if given, sharded over the ranks (their parameters become
    DTensors, gathered for each forward)."""
    for layer in layers:
        fully_shard(layer)
    if root is not None:
        fully_shard(root)


def full_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole (unsharded) state of `model` and `optimizer`, keyed by parameter name, on the CPU; every rank
    must call it (sharded parameters are gathered)."""
    return get_model_state_dict(model, options=_FULL), get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_states(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, state: dict) -> None:
    """Load `full_states`' output into `model` and `optimizer`, sharded or not."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    if all(isinstance(key, int) for key in state["state"]):  # written before states were keyed by name
        optimizer.load_state_dict(state)
    else:
        set_optimizer_state_dict(model, optimizer, state, options=options)
