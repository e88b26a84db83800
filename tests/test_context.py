"""The context fed to the drafter is exactly the target's hidden states of the verified prefix.

Over a whole `generate` call, the `target_hidden` chunks the drafter receives, concatenated, must equal the
target-layer hidden states of the committed tokens recomputed in ONE plain forward of the final output, at
contiguous positions 0..N-1, where N is the anchor position of the last drafted block (every committed token
but the last one at that round). Rejected drafts must never leak into the context.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ScriptedDrafter, make_drafter, make_target

VOCAB, HIDDEN = 48, 64  # vocab <= hidden lets ScriptedDrafter invert the LM head exactly
MAX_NEW = 40


def _record(drafter):
    calls = []

    def hook(module, args, kwargs, output):
        calls.append(
            {
                "target_hidden": kwargs["target_hidden"].detach().clone(),
                "context_position_ids": kwargs["context_position_ids"].detach().clone(),
                "block_position_ids": kwargs["block_position_ids"].detach().clone(),
            }
        )

    return calls, drafter.register_forward_hook(hook, with_kwargs=True)


def _generate(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind", ["random", "scripted"])
def test_drafter_context_is_verified_prefix_hidden_states(family, kind):
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=4)
    prompt = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(5))
    expected = _generate(target, prompt)
    block_size = 6
    if kind == "random":
        drafter = make_drafter(target, seed=3, block_size=block_size)
    else:
        torch.manual_seed(3)
        drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
        drafter.rig(target, expected, error_rate=0.25, seed=7)
    calls, handle = _record(drafter)
    try:
        # every round drafts (no guard): the context is followed over many rounds, whatever this machine's timing
        output = _generate(target, prompt, assistant_model=drafter, draft_controller=block_size)
    finally:
        handle.remove()
    assert torch.equal(output, expected)
    stats = drafter.last_stats
    assert len(calls) == stats.drafter_forwards >= 3
    if kind == "scripted":  # several drafts accepted in a round, so context chunks span several tokens
        assert max(stats.accepted_per_round) >= 2
        assert any(0 < a < d for a, d in zip(stats.accepted_per_round, stats.drafted_per_round))

    # positions: contiguous from 0, and each block is anchored right after the context seen so far
    seen = 0
    for i, call in enumerate(calls):
        pos = call["context_position_ids"]
        assert pos.shape == (1, call["target_hidden"].shape[1])
        assert torch.equal(pos[0], torch.arange(seen, seen + pos.shape[1])), f"call {i}: {pos}"
        assert pos.shape[1] >= 1  # each round verifies at least one new token
        seen += pos.shape[1]
        anchor = int(call["block_position_ids"][0, 0])
        assert anchor == seen, f"call {i}: block anchored at {anchor}, context covers 0..{seen - 1}"
        width = call["block_position_ids"].shape[1]  # the last rounds draft only the tokens still allowed
        assert 2 <= width <= block_size and anchor + width <= prompt.shape[1] + MAX_NEW + 1
        assert torch.equal(call["block_position_ids"][0], torch.arange(anchor, anchor + width))
    context_positions = torch.cat([c["context_position_ids"] for c in calls], dim=1)
    num_ctx = context_positions.shape[1]
    assert torch.equal(context_positions[0], torch.arange(num_ctx))
    # the first round's context is the whole prompt; the last covers all committed tokens but the last at that
    # round (its anchor, checked above), after which at most one block plus one undrafted token is committed
    assert calls[0]["context_position_ids"].shape[1] == prompt.shape[1]
    assert output.shape[1] - block_size - 2 <= num_ctx <= output.shape[1] - 2

    # values: one plain forward over the final output
    context = torch.cat([c["target_hidden"] for c in calls], dim=1)
    with torch.no_grad():
        plain = target(output, output_hidden_states=True)
    reference = torch.cat([plain.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)[:, :num_ctx]
    assert context.shape == reference.shape
    torch.testing.assert_close(context, reference, atol=1e-5, rtol=1e-5)
    # and it is not trivially satisfied: hidden states of other layers or shifted tokens differ
    shifted = torch.cat([plain.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)[:, 1 : num_ctx + 1]
    assert not torch.allclose(context, shifted, atol=1e-3)
    other = torch.cat([plain.hidden_states[i] for i in drafter.target_layer_ids], dim=-1)[:, :num_ctx]
    assert not torch.allclose(context, other, atol=1e-3)
