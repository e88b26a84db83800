"""Oracle labels: replaying only the drafter equals real greedy decoding, round for round."""

from __future__ import annotations

import torch
from conftest import ScriptedDrafter, make_drafter, make_target

from hf_blockpilot.training.oracle import replay_block_size

VOCAB, HIDDEN = 48, 64


def _real(target, drafter, prompt, max_new, eos):
    out = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          assistant_model=drafter)
    return out, drafter.last_stats


def test_replay_equals_real_decoding(family):
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=4)
    checked = partial = 0
    for case in range(8):
        g = torch.Generator().manual_seed(case)
        prompt = torch.randint(3, VOCAB, (1, 5 + 3 * case), generator=g)
        max_new = 12 + 5 * case
        reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        eos = int(reference[0, -max_new // 3]) if case % 2 else None
        if eos is not None:
            reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
        hidden = target(reference, output_hidden_states=True).hidden_states
        for block_size in (2, 4, 7, 16):
            for scripted in (True, False):
                if scripted:
                    drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
                    drafter.rig(target, reference, error_rate=0.3, seed=case)
                else:
                    drafter = make_drafter(target, block_size=block_size, seed=case)
                out, real = _real(target, drafter, prompt, max_new, eos)
                assert torch.equal(out, reference)
                if scripted:
                    drafter.rig(target, reference, error_rate=0.3, seed=case)  # same error draws again
                sim = replay_block_size(target, drafter, hidden, reference, prompt.shape[1], block_size, max_new,
                                        [eos] if eos is not None else [])
                msg = f"case {case} b={block_size} scripted={scripted}"
                assert sim.accepted_per_round == real.accepted_per_round, msg
                assert sim.drafted_per_round == real.drafted_per_round, msg
                assert sim.target_forwards == real.target_forwards and sim.new_tokens == real.new_tokens, msg
                assert sim.tau == real.tau, msg
                checked += 1
                partial += any(0 < a < d for a, d in zip(real.accepted_per_round, real.drafted_per_round))
    assert checked == 64 and partial > 0
