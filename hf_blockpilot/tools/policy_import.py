"""Convert the BlockPilot authors' predictor checkpoint (AMAP-ML/BlockPilot `utils/model.pt`) into our Hub policy.

Their layout: a raw (usually bf16) state dict saved with `torch.save`, `layers.0.{weight,bias}` (vocab -> width),
`layers.1..{weight,bias}` (width -> width, residual), `fc_out.{weight,bias}` (width -> one class per candidate
block size, 14..18 in their release), read over the target's last-token prefill logits.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..policy import LastLogitsMLPPolicy, drafter_fingerprint

AUTHORS_CANDIDATES = (14, 15, 16, 17, 18)  # `k = pred + 14` in their predict.py
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(weight|bias)")


class AuthorsPredictor(NamedTuple):
    """The authors' predictor as read from `path`: its state dict, checked to be in their layout, and depth."""

    path: Path
    state: dict[str, torch.Tensor]
    depth: int


def read_authors_predictor(path: str | Path) -> AuthorsPredictor:
    """Read the authors' `model.pt` (tensors only: never runs pickled code) and check its layout."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no predictor checkpoint at {path}: pass the authors' model.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:  # not a (tensor-only) torch file
        raise ValueError(f"{path} is not a readable torch state dict ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors (the authors' MLP layout)")
    layers = sorted({int(m.group(1)) for key in state if (m := _LAYER_KEY.fullmatch(key))})
    expected = {f"layers.{i}.{p}" for i in range(len(layers)) for p in ("weight", "bias")}
    expected |= {"fc_out.weight", "fc_out.bias"}
    if not layers or layers != list(range(len(layers))) or set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"{path} is not in the BlockPilot predictor layout (layers.0..N.{{weight,bias}}, fc_out.{{weight,bias}}): "
            f"missing {missing or 'none'}, unexpected {extra or 'none'}"
        )
    return AuthorsPredictor(path, state, len(layers))


def import_authors_policy(
    checkpoint: str | Path | AuthorsPredictor,
    target: nn.Module,
    drafter: nn.Module | None = None,
    candidates: Sequence[int] = AUTHORS_CANDIDATES,
    target_name: str = "",
    drafter_name: str = "",
) -> LastLogitsMLPPolicy:
    """A `LastLogitsMLPPolicy` with the weights of the authors' `model.pt`
    (a path, or what `read_authors_predictor` read from it).

    `target`: the model whose last-token logits it reads (its vocabulary must be the predictor's input width);
    `candidates`: the block size of each output class, in order; `drafter` (optional): recorded by fingerprint,
    so attaching the policy to another drafter warns. The checkpoint's dtype is kept (bf16 in their release).
    """
    predictor = checkpoint if isinstance(checkpoint, AuthorsPredictor) else read_authors_predictor(checkpoint)
    path, state, depth = predictor
    width, vocab = state["layers.0.weight"].shape
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if vocab != target_vocab:
        raise ValueError(
            f"{path} reads {vocab} logits, but the target's vocabulary has {target_vocab}: it was trained for another "
            "target; pass the target it was trained with"
        )
    num_classes = state["fc_out.weight"].shape[0]
    if len(candidates) != num_classes:
        raise ValueError(
            f"{path} has {num_classes} output classes, but {len(candidates)} candidate block sizes were given "
            f"({list(candidates)}); pass one block size per class, in class order"
        )
    dtype = state["fc_out.weight"].dtype
    policy = LastLogitsMLPPolicy(
        candidates=list(candidates),
        target_vocab_size=target_vocab,
        width=width,
        depth=depth,
        dropout=0.2,  # theirs; inactive in eval mode
        target_name=target_name,
        drafter_name=drafter_name,
        drafter_fingerprint=drafter_fingerprint(drafter) if drafter is not None else "",
        training_loss="imported from the BlockPilot authors' predictor (cross-entropy to the best block size)",
        dtype=str(dtype).removeprefix("torch."),
    )
    try:
        policy.logits_mlp.load_state_dict(state)
    except RuntimeError as err:  # e.g. a hidden layer that is not width x width
        raise ValueError(f"{path}: a tensor's shape does not fit the predictor layout: {err}") from None
    return policy.eval()
