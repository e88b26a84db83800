"""Training DFlash 2 drafters: the convolutions stay within each packed block, the candidate selector learns, and
a trained checkpoint drafts in the authors' reference classes (PyPI `dflash==0.1.0`) exactly what it drafts here
(the teacher-forced replay equal to real greedy decoding: `test_training.py`)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import init_dflash2, make_target
from test_reference_parity import VOCAB, _target, assert_rounds_equal_the_reference
from test_training import DFLASH2_SIZES, own_responses_trainer

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.configuration_block_diffusion import DFLASH2_DEFAULT_SIZES
from hf_blockpilot.training.drafter import (
    block_attention_mask,
    init_drafter_from_target,
    train_drafter,
)

SIZES = DFLASH2_SIZES


def test_from_target_builds_a_dflash2_drafter_that_starts_as_its_v1_twin():
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    v2 = BlockDiffusionDrafter.from_target(target, num_hidden_layers=2, block_size=4, dflash2=SIZES).eval()
    v1 = BlockDiffusionDrafter.from_target(target, num_hidden_layers=2, block_size=4).eval()
    assert v2.config.is_dflash2 and not v1.config.is_dflash2 and v2.candidate_selector.top_k == 5
    assert v2.config.to_dict()["architectures"] == ["DFlash2DraftModel"]
    init_drafter_from_target(v1, target)
    init_drafter_from_target(v2, target)
    inputs = dict(
        block_embeds=torch.randn(1, 4, 64),
        block_position_ids=torch.arange(9, 13)[None],
        target_hidden=torch.randn(1, 9, 64 * len(v1.target_layer_ids)),
        context_position_ids=torch.arange(9)[None],
    )
    with torch.no_grad():  # the convolutions start as the identity (the dynamic taps add x * 0 before the block)
        torch.nn.init.zeros_(v2.layers[0].attention_conv.kernel_projection.weight)
        for layer in v2.layers:
            torch.nn.init.zeros_(layer.attention_conv.kernel_projection.weight)
            torch.nn.init.zeros_(layer.mlp_conv.kernel_projection.weight)
        torch.testing.assert_close(v2(**inputs).last_hidden_state, v1(**inputs).last_hidden_state)
    with pytest.raises(ValueError, match="draft_vocab_size=None"):
        train_drafter(target, None, "unused", dflash2=SIZES, draft_vocab_size=64)
    assert set(DFLASH2_DEFAULT_SIZES) == set(SIZES)


def test_packed_blocks_are_convolved_block_by_block():
    """A training forward over several blocks (one sequence, `block_attention_mask`) gives every block what the
    drafter gives it alone: the convolutions never reach across a block boundary."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=2, block_size=4, dflash2=SIZES).double()
    init_dflash2(drafter, seed=0, sharpen=1.0)
    drafter.eval()
    b, width = 4, 20
    anchors = torch.tensor([3, 8, 14])
    context = torch.randn(1, width, 64 * len(drafter.target_layer_ids), dtype=torch.float64)
    blocks = torch.randn(1, len(anchors) * b, 64, dtype=torch.float64)
    positions = (anchors[:, None] + torch.arange(b)).reshape(1, -1)
    with torch.no_grad():
        packed = drafter(
            block_embeds=blocks,
            block_position_ids=positions,
            target_hidden=context,
            context_position_ids=torch.arange(width)[None],
            attention_mask=block_attention_mask(anchors, b, width)[None, None],
            block_size=b,
        ).last_hidden_state
        for j, anchor in enumerate(anchors.tolist()):
            alone = drafter(
                block_embeds=blocks[:, j * b : (j + 1) * b],
                block_position_ids=positions[:, j * b : (j + 1) * b],
                target_hidden=context[:, :anchor],
                context_position_ids=torch.arange(anchor)[None],
            ).last_hidden_state
            torch.testing.assert_close(packed[:, j * b : (j + 1) * b], alone)
        leaky = drafter(  # without block_size the query would be convolved as one long block
            block_embeds=blocks,
            block_position_ids=positions,
            target_hidden=context,
            context_position_ids=torch.arange(width)[None],
            attention_mask=block_attention_mask(anchors, b, width)[None, None],
        ).last_hidden_state
    assert not torch.allclose(leaky[:, b : 2 * b], packed[:, b : 2 * b])


def _trained_dflash2(tmp_path, target, steps: int):
    return own_responses_trainer(tmp_path, target, steps, dflash2=SIZES, save_every=steps)[1:]


def test_dflash2_training_lowers_the_loss_and_trains_the_selector(tmp_path):
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    _, _, seqs, trainer = _trained_dflash2(tmp_path, target, steps=200)
    selector = trainer.drafter.candidate_selector
    codebook = selector.predecessor_codebook.weight.detach().clone()
    hidden = trainer.hidden_states(seqs)
    rng = random.Random(5)
    anchors = trainer.random_anchors(seqs, [rng] * len(seqs))
    with torch.no_grad():
        before, before_acc = trainer.batch_loss(seqs, hidden, anchors=anchors)
    trainer.train()
    with torch.no_grad():
        after, after_acc = trainer.batch_loss(seqs, hidden, anchors=anchors)
    assert after < 0.5 * before, (before, after)
    assert after_acc["correct"].sum() > before_acc["correct"].sum()
    assert not torch.equal(selector.predecessor_codebook.weight, codebook)  # the selector loss reaches it
    assert (tmp_path / "run" / "checkpoint" / "config.json").exists()


def test_trained_dflash2_checkpoint_drafts_alike_in_the_reference(tmp_path, monkeypatch):
    """A DFlash 2 drafter trained here, saved at a checkpoint, loads in `dflash==0.1.0`'s `DFlash2DraftModel`
    and decodes greedily round for round as ours does."""
    reference = pytest.importorskip("dflash.model", reason="the reference: pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its timer assumes CUDA
    target = _target("qwen3", seed=0)
    *_, trainer = _trained_dflash2(tmp_path, target, steps=40)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint"
    ref = reference.DFlash2DraftModel.from_pretrained(checkpoint, dtype=torch.float64).eval()
    ours = BlockDiffusionDrafter.from_pretrained(checkpoint, dtype=torch.float64).eval()
    assert ours.config.is_dflash2 and ref.candidate_selector.top_k == SIZES["selector_top_k"]
    target = target.double()
    rng = random.Random(0)
    full = sum(assert_rounds_equal_the_reference(ref, ours, target, rng, case)[0] for case in range(8))
    assert full > 0  # some rounds accept the whole block: the drafts are not trivially rejected
    assert target.config.vocab_size == VOCAB
