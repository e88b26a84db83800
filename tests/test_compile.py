"""`generate(..., compile=True)`: the target's forwards after the prefill run torch.compile'd over a static cache,
token-identical to plain greedy `generate`, with decisions weighing the compiled forwards' own timings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import BatchScriptedDrafter, ScriptedDrafter, make_target

from hf_blockpilot import CostModel
from hf_blockpilot.batched import CAPACITY_STEP, RaggedCache, static_capacity
from hf_blockpilot.device_calibration import compiled_cost_model

VOCAB = 48


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, hidden_size=64, layers=2, seed=5)


def _rigged(target, plain, block_size=4, error_rate=0.3):
    drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
    return drafter.rig(target, plain, error_rate=error_rate, seed=1)


def test_compiled_greedy_equals_plain_for_one_row_and_a_padded_batch(target):
    prompts = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    gen = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    plain = target.generate(prompts[:1], **gen)
    drafter = _rigged(target, plain)
    out = target.generate(
        prompts[:1], assistant_model=drafter, draft_controller=4, compile=True, return_dict_in_generate=True, **gen
    )
    assert torch.equal(out.sequences, plain)
    assert "compiled" in out.speculation_stats.cost_model_source
    assert max(out.speculation_stats.accepted_per_round) >= 2  # verify forwards over several tokens ran compiled
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # row 1 left-padded
    batch_plain = target.generate(prompts, attention_mask=mask, **gen)
    scripts = [
        row[mask_row.bool().tolist() + [True] * gen["max_new_tokens"]].tolist()
        for row, mask_row in zip(batch_plain, mask)
    ]
    batch_drafter = BatchScriptedDrafter.from_target(target, block_size=4).eval().rig(target, scripts, error_rate=0.2)
    batch = target.generate(
        prompts, attention_mask=mask, assistant_model=batch_drafter, draft_controller=4, compile=True, **gen
    )
    assert torch.equal(batch, batch_plain)


def test_compile_leaves_the_users_call_settings_alone(target):
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    drafter = _rigged(target, target.generate(prompt, do_sample=False, max_new_tokens=4, pad_token_id=0))
    with pytest.raises(ValueError, match="compile=True returns no attentions"):
        target.generate(
            prompt,
            assistant_model=drafter,
            compile=True,
            output_attentions=True,
            return_dict_in_generate=True,
            max_new_tokens=4,
        )


def test_static_capacity_holds_the_longest_row_and_block_in_shared_steps():
    assert static_capacity(100, 16) == CAPACITY_STEP
    assert static_capacity(CAPACITY_STEP, 1) == 2 * CAPACITY_STEP  # one slot past a step: the next step
    assert static_capacity(300, 16) % CAPACITY_STEP == 0 and static_capacity(300, 16) >= 316


def test_static_ragged_cache_keeps_its_storage_and_masks_what_rows_have_not_written():
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.randn(2, 1, 3, 4)
    cache.update(keys, keys.clone(), 0)
    prompt = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    plan = RaggedCache.convert(cache, prompt, padded=True, single=False, capacity=8)
    mask = plan.prepare(2)
    assert mask.shape == (2, 1, 2, 8)  # every forward sees the whole storage: fixed shapes
    assert mask[0, 0, 0].tolist() == [False, True, True, True, False, False, False, False]
    assert mask[1, 0, 1].tolist() == [True] * 5 + [False] * 3
    new = torch.randn(2, 1, 2, 4)
    stored_keys, _ = cache.layers[0].update(new, new.clone())
    assert stored_keys.shape[-2] == 8 and torch.equal(stored_keys[:, :, 3:5], new)


def test_compiled_cost_model_times_each_width_and_flags_one_that_rounds_unlike_plain_steps(target):
    """CPU-independent: a stand-in for the compiled call that perturbs forwards over 3 or more tokens must be
    caught by the probe, whatever this machine's kernels do."""

    def perturbed(**kwargs):
        outputs = target(**kwargs)
        if kwargs["input_ids"].shape[1] >= 3:
            outputs.logits = outputs.logits + 1e-3
        return outputs

    shipped = CostModel(target_ms={1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 8: 20.0}, drafter_ms={2: 1.0, 8: 2.0})
    cost = compiled_cost_model(target, perturbed, shipped, max_width=4, capacity=CAPACITY_STEP, repeats=1)
    assert sorted(cost.target_ms) == [1, 2, 3, 4]  # widths past the call's widest are not compiled for it
    assert all(ms > 0 for ms in cost.target_ms.values()) and cost.target_ms != shipped.target_ms
    assert {3, 4} <= set(cost.inexact_rows)
    assert "compiled" in cost.source and cost.drafter_ms == shipped.drafter_ms  # no compiled drafter given
    again = compiled_cost_model(target, perturbed, dataclasses.replace(shipped), 4, CAPACITY_STEP, repeats=1)
    assert again.target_ms == cost.target_ms  # measured once per target and shapes


def test_compiled_cost_model_times_the_compiled_drafter_per_width(target):
    from conftest import make_drafter
    from transformers import CompileConfig

    drafter = make_drafter(target, block_size=4, num_hidden_layers=1)
    calls = []
    compiled_forward = drafter.compiled_forward(CompileConfig(fullgraph=True))

    def compiled_drafter(**kwargs):
        calls.append(kwargs["block_embeds"].shape[1])
        return compiled_forward(**kwargs)

    shipped = CostModel(target_ms={1: 10.0, 2: 11.0, 4: 13.0}, drafter_ms={2: 50.0, 4: 60.0, 8: 70.0})
    cost = compiled_cost_model(target, target, shipped, 4, CAPACITY_STEP, drafter, compiled_drafter, repeats=1)
    assert set(calls) == {2, 4}  # the widths the call may draft, each through the compiled block forward
    assert cost.drafter_ms[8] == 70.0 and all(0 < cost.drafter_ms[n] < 50.0 for n in (2, 4))
    assert "target and drafter forwards timed compiled" in cost.source
