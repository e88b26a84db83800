"""Calibrating the per-round controller: recorded rounds, the fitted acceptance model, and where it is stored."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ScriptedDrafter, greedy_generate, make_drafter, make_target
from test_policy_training import CANDIDATES, _records

from hf_blockpilot import AdaptiveVerify, BlockPilotPolicy, CostModel
from hf_blockpilot.controllers import AcceptanceModel, DraftedRound
from hf_blockpilot.policy import PrefillMLPPolicy
from hf_blockpilot.training.calibration import RoundRecorder, fit_acceptance_model
from hf_blockpilot.training.policy_training import PolicyTrainingConfig, objective_values, train_policy

VOCAB, HIDDEN = 48, 64


def _recorded_rows(cases: int = 12) -> list:
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, seed=1)
    recorder = RoundRecorder(8)
    for case in range(cases):
        prompt = torch.randint(3, VOCAB, (1, 6 + case), generator=torch.Generator().manual_seed(case))
        expected = greedy_generate(target, prompt, 40, None)
        drafter = ScriptedDrafter.from_target(target, block_size=8).eval()
        drafter.rig(target, expected, error_rate=0.3, seed=case, varied_confidence=True)
        out = greedy_generate(target, prompt, 40, None, assistant_model=drafter, draft_controller=recorder)
        assert torch.equal(out, expected)  # recording changes nothing
        stats = drafter.last_stats
        assert stats.drafted_per_round[1:-1] and max(stats.drafted_per_round) == 7  # every draft verified
    return recorder.rows


def test_recorded_rounds_fit_an_acceptance_model_that_tracks_acceptance():
    rows = _recorded_rows()
    labels = torch.tensor([r[4] for r in rows])
    assert 0.2 < labels.mean() < 0.95, "rows must hold both accepted and rejected slots"
    assert all(r[0] == 0 or any(q[0] == r[0] - 1 for q in rows) for r in rows)  # slot j only after slot j - 1
    model = fit_acceptance_model(rows, num_slots=4, min_rows=10)
    assert model.rounds == sum(1 for r in rows if r[0] == 0)
    assert model.confidence_weight[0] > 0, "the rigged drafter is less sure where it is wrong"
    first = [r for r in rows if r[0] == 0]
    predicted = model.per_slot(DraftedRound(1, torch.tensor([first[0][1]]), torch.tensor([first[0][2]])))
    assert 0.0 < float(predicted) < 1.0
    mean_prediction = torch.stack(
        [model.per_slot(DraftedRound(1, torch.tensor([r[1]]), torch.tensor([r[2]])))[0] for r in first]
    ).mean()
    assert mean_prediction == pytest.approx(sum(r[4] for r in first) / len(first), abs=0.05)  # calibrated in the mean
    with pytest.raises(ValueError, match="no calibration rows"):
        fit_acceptance_model([])


def test_soft_labels_and_lookup_rows():
    rows = (
        [(0, 0.9, 0.1, 0, 0.8)] * 30
        + [(0, 0.3, 2.0, 0, 0.1)] * 30
        + [(0, 1.0, 0.0, 1, 1.0)] * 15
        + [(0, 1.0, 0.0, 1, 0.0)] * 15
        + [(1, 0.9, 0.1, 0, 0.7)] * 5
    )
    model = fit_acceptance_model(rows, num_slots=3, min_rows=10)
    assert model.lookup_rate == [0.5]
    assert len(model.bias) == 1  # slots 1 and 2 had too few rows: they reuse slot 0's fit
    sure, unsure = model.per_slot(DraftedRound(2, torch.tensor([0.9, 0.3]), torch.tensor([0.1, 2.0])))
    assert sure == pytest.approx(0.8, abs=0.05) and unsure == pytest.approx(0.1, abs=0.05)


def test_policy_carries_the_verify_model_through_save_and_strict_load(tmp_path):
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, seed=0)
    policy = PrefillMLPPolicy(
        candidates=[2, 6], feature_layers=[1], target_hidden_size=HIDDEN, target_vocab_size=VOCAB, target_num_layers=4
    )
    acceptance = AcceptanceModel(
        bias=[0.5, 0.1], confidence_weight=[1.0, 1.2], entropy_weight=[-0.3, -0.2], lookup_rate=[0.7], rounds=40
    )
    cost = CostModel(target_ms={1: 30.0, 6: 60.0}, drafter_ms={6: 4.0}, device="cpu")
    policy.attach_verify_model(acceptance, cost)
    policy.save_pretrained(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["acceptance_model"]["rounds"] == 40 and config["cost_model"]["target_ms"]["6"] == 60.0
    card = (tmp_path / "p" / "README.md").read_text()
    assert "calibrated acceptance" in card and "fitted on 40 rounds" in card
    loaded = BlockPilotPolicy.from_pretrained(tmp_path / "p")
    assert loaded.acceptance_model == acceptance and loaded.cost_model == cost
    controller = AdaptiveVerify(policy=loaded)
    # the labelling machine's costs stay a record: decisions weigh the serving machine's (resolved per request)
    assert controller.acceptance == acceptance and controller.cost_model is None
    assert "calibrated" in controller.describe()
    # a policy without one falls back to the entropy bound
    bare = PrefillMLPPolicy(
        candidates=[2, 6], feature_layers=[1], target_hidden_size=HIDDEN, target_vocab_size=VOCAB, target_num_layers=4
    )
    assert "entropy bound" in AdaptiveVerify(policy=bare).describe()
    drafter = make_drafter(target, block_size=4)
    out = target.generate(
        torch.tensor([[3, 4, 5]]),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        assistant_model=drafter,
        draft_controller=controller,
    )
    assert out.shape[1] == 11 and drafter.last_stats.block_size in (2, 6)


def test_train_policy_fits_and_stores_the_acceptance_model_and_uses_modeled_times():
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=4, seed=0)
    drafter = make_drafter(target, block_size=4)
    records = _records(60)
    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    for i, r in enumerate(records):
        r.slot_rows = [[0, 0.9, 0.2, 0, float(i % 3 > 0)], [1, 0.5, 1.0, 0, float(i % 2)]] * 12
    policy, _ = train_policy(
        records, CANDIDATES, [1], target, drafter, PolicyTrainingConfig(objective="throughput", epochs=20), cost
    )
    assert policy.acceptance_model is not None and policy.acceptance_model.rounds == 60 * 12
    assert policy.cost_model == cost
    # labels with modeled times (collected under the adaptive controller) are scored by them
    record = records[0]
    record.ms = {1: 5000.0, 4: 2500.0, 8: 2000.0}
    assert objective_values(record, CANDIDATES, "throughput", cost) == pytest.approx(
        [1000 * record.new_tokens / record.ms[b] for b in CANDIDATES]
    )


def test_a_policy_trained_on_composed_labels_serves_under_adaptive_verify_by_default(tmp_path):
    """Labels collected under the per-round controller (`collect --adaptive`) rank widths as they pay *with* it:
    such a policy records that and is served under `AdaptiveVerify` when no controller is passed; a policy of
    fully verified labels keeps every draft verified. Mixed labels are refused."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=4, seed=0)
    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    config = PolicyTrainingConfig(objective="throughput", epochs=5)
    composed = _records(30)
    for r in composed:
        r.controller = "adaptive"
    with pytest.raises(ValueError, match="mix"):
        train_policy(composed[:15] + _records(15, seed=1), CANDIDATES, [1], target, make_drafter(target), config, cost)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = greedy_generate(target, prompt, 24, None)
    cases = [(composed, "adaptive", "adaptive(policy"), (_records(30), "fixed", "policy")]
    for records, label_controller, served_by in cases:
        policy, _ = train_policy(records, CANDIDATES, [1], target, make_drafter(target), config, cost)
        assert policy.label_controller == label_controller
        policy.save_pretrained(tmp_path / label_controller)
        card = (tmp_path / label_controller / "README.md").read_text()
        assert ("cut by the per-round controller" in card) == (label_controller == "adaptive")
        drafter = make_drafter(target, block_size=4)
        drafter.set_policy(tmp_path / label_controller)  # strict load keeps the field
        out = greedy_generate(target, prompt, 24, None, assistant_model=drafter)
        assert torch.equal(out, expected)
        assert drafter.last_stats.controller.startswith(f"guarded({served_by}")
    with pytest.raises(ValueError, match="label_controller"):
        PrefillMLPPolicy(
            candidates=[2],
            feature_layers=[1],
            target_hidden_size=HIDDEN,
            target_vocab_size=VOCAB,
            target_num_layers=4,
            label_controller="sometimes",
        )
