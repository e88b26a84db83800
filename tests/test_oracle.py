"""Oracle labels: replaying only the drafter equals real greedy decoding, round for round."""

from __future__ import annotations

import pytest
import torch
from conftest import ScriptedDrafter, make_drafter, make_target

from hf_blockpilot.device_calibration import sampling_processors
from hf_blockpilot.training.oracle import expected_sampled_stats, replay_block_size

VOCAB, HIDDEN = 48, 64


def _real(target, drafter, prompt, max_new, eos):
    out = target.generate(
        prompt,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        assistant_model=drafter,
        draft_controller=drafter.block_size,
    )  # every draft verified
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
            reference = target.generate(
                prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0
            )
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
                sim = replay_block_size(
                    target,
                    drafter,
                    hidden,
                    reference,
                    prompt.shape[1],
                    block_size,
                    max_new,
                    [eos] if eos is not None else [],
                )
                msg = f"case {case} b={block_size} scripted={scripted}"
                assert sim.accepted_per_round == real.accepted_per_round, msg
                assert sim.drafted_per_round == real.drafted_per_round, msg
                assert sim.target_forwards == real.target_forwards and sim.new_tokens == real.new_tokens, msg
                assert sim.tau == real.tau, msg
                checked += 1
                partial += any(0 < a < d for a, d in zip(real.accepted_per_round, real.drafted_per_round))
    assert checked == 64 and partial > 0


def test_replay_equals_real_decoding_with_prompt_lookup(family):
    """Labels collected with `drafter.prompt_lookup` replay lookup rounds exactly as decoding runs them."""
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=4)
    lookups = drafted = 0
    for case in range(6):
        motif = torch.randint(3, VOCAB, (1, 2 + case % 3), generator=torch.Generator().manual_seed(case))
        prompt = motif.repeat(1, 4)
        max_new = 20 + 4 * case
        reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        hidden = target(reference, output_hidden_states=True).hidden_states
        for block_size in (3, 8):
            drafter = make_drafter(target, block_size=block_size, seed=case)
            drafter.prompt_lookup = True
            out, real = _real(target, drafter, prompt, max_new, None)
            assert torch.equal(out, reference)
            sim = replay_block_size(target, drafter, hidden, reference, prompt.shape[1], block_size, max_new)
            msg = f"case {case} b={block_size}"
            assert sim.accepted_per_round == real.accepted_per_round, msg
            assert sim.drafted_per_round == real.drafted_per_round, msg
            assert (sim.lookup_rounds, sim.drafter_forwards) == (real.lookup_rounds, real.drafter_forwards), msg
            assert sim.tau == real.tau, msg
            lookups += real.lookup_rounds
            drafted += real.drafter_forwards
    assert lookups > 0 and drafted > 0


def test_sampling_processors_are_the_ones_generate_samples_with():
    """The T>0 labels' target distributions: sampling token by token from them, with generate's seed, must
    give generate's own sampled output (the target's generation defaults, here top-k, merged as generate does)."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=2)
    target.generation_config.top_k = 7
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    processors = sampling_processors(target, prompt, temperature=0.8)
    torch.manual_seed(5)
    sampled = target.generate(prompt, do_sample=True, temperature=0.8, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(5)
    ids = prompt
    for _ in range(10):
        logits = processors(ids, target(ids).logits[:, -1].float())
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=-1)
    assert torch.equal(ids, sampled)


def test_expected_sampled_stats_equal_the_greedy_replay_when_sampling_is_deterministic(family):
    """With top-k = 1 sampling is greedy and every acceptance probability is 0 or 1: the expected τ and round
    count must be exactly the greedy replay's (itself equal to real decoding)."""
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=4)
    target.generation_config.top_k = 1
    partial = 0
    for case in range(4):
        prompt = torch.randint(3, VOCAB, (1, 5 + 2 * case), generator=torch.Generator().manual_seed(case))
        max_new = 14 + 4 * case
        reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = target(reference, output_hidden_states=True)
        processors = sampling_processors(target, prompt, temperature=1.0)
        for block_size in (2, 4, 7):
            drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
            drafter.rig(target, reference, error_rate=0.3, seed=case, by_position=True)
            greedy = replay_block_size(
                target, drafter, out.hidden_states, reference, prompt.shape[1], block_size, max_new
            )
            tau, forwards, _ = expected_sampled_stats(
                target,
                drafter,
                out.hidden_states,
                out.logits,
                reference,
                prompt.shape[1],
                block_size,
                max_new,
                processors,
            )
            assert forwards == greedy.target_forwards and tau == pytest.approx(greedy.tau), (case, block_size)
            partial += any(0 < a < block_size - 1 for a in greedy.accepted_per_round)
    assert partial > 0


def test_expected_sampled_tau_tracks_real_speculative_sampling():
    """At T=1 the labels' expected τ, averaged over sampled continuations, must be close to the τ that real
    speculative sampling reaches on average (the estimator conditions later slots on the continuation's
    tokens, an approximation; 400 real runs and 100 continuations, fixed seeds)."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=3)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    max_new, block_size = 16, 4
    drafter = make_drafter(target, block_size=block_size, seed=2)
    processors = sampling_processors(target, prompt, temperature=1.0)
    config = dict(do_sample=True, temperature=1.0, max_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
    real = []
    for seed in range(400):
        torch.manual_seed(seed)
        target.generate(prompt, **config, assistant_model=drafter)
        real.append(drafter.last_stats.tau)
    expected = []
    for seed in range(100):
        torch.manual_seed(10_000 + seed)
        sequence = target.generate(prompt, **config)
        out = target(sequence, output_hidden_states=True)
        tau, _, _ = expected_sampled_stats(
            target, drafter, out.hidden_states, out.logits, sequence, prompt.shape[1], block_size, max_new, processors
        )
        expected.append(tau)
    real_mean, expected_mean = sum(real) / len(real), sum(expected) / len(expected)
    assert real_mean > 1.2, "the drafter must be accepted sometimes for this check to mean anything"
    assert expected_mean == pytest.approx(real_mean, rel=0.05), (expected_mean, real_mean)


def test_replay_under_the_adaptive_controller_equals_real_decoding(family):
    """Labels of the composed system: the replay cuts rounds exactly as `generate` with the same controller
    does, and its modeled time is the cost model summed over those rounds."""
    from hf_blockpilot import AdaptiveVerify, CostModel
    from hf_blockpilot.controllers import AcceptanceModel
    from hf_blockpilot.training.calibration import RoundRecorder

    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=6)
    cost = CostModel(target_ms={1: 50.0, 2: 52.0, 4: 90.0, 8: 160.0}, drafter_ms={2: 5.0, 8: 8.0})
    acceptance = AcceptanceModel(bias=[-1.0], confidence_weight=[1.5], entropy_weight=[-0.5])
    truncated = 0
    for case in range(6):
        prompt = torch.randint(3, VOCAB, (1, 6 + case), generator=torch.Generator().manual_seed(case))
        max_new = 24
        reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        drafter = ScriptedDrafter.from_target(target, block_size=8).eval()
        drafter.rig(target, reference, error_rate=0.25, seed=case, by_position=True, varied_confidence=True)
        controller = AdaptiveVerify(8, acceptance=acceptance, cost_model=cost)
        real = target.generate(
            prompt,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            assistant_model=drafter,
            draft_controller=controller,
        )
        assert torch.equal(real, reference)
        real_stats = drafter.last_stats
        # the same draws again: the rigged drafter's random margins follow its call order
        drafter.rig(target, reference, error_rate=0.25, seed=case, by_position=True, varied_confidence=True)
        hidden = target(reference, output_hidden_states=True).hidden_states
        recorder = RoundRecorder(controller)
        sim = replay_block_size(target, drafter, hidden, reference, prompt.shape[1], recorder, max_new)
        assert sim.drafted_per_round == real_stats.drafted_per_round, case
        assert sim.accepted_per_round == real_stats.accepted_per_round, case
        truncated += sum(d < w - 1 for d, w in zip(sim.drafted_per_round, sim.widths_per_round) if w > 1)
        assert cost.modeled_decode_ms(sim) == pytest.approx(
            sum(cost.modeled_round_ms(w, d) for w, d in zip(sim.widths_per_round, sim.drafted_per_round))
        )
        # one calibration row per slot up to the first rejection
        assert len(recorder.rows) == sum(a + (a < d) for a, d in zip(sim.accepted_per_round, sim.drafted_per_round))
    assert truncated > 0
