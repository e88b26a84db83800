"""Policy training on oracle records: objectives, losses, early stopping, the held-out report."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_drafter, make_target

from hf_blockpilot.policy import MIN_PREDICTED_GAIN, NUM_SCALAR_FEATURES
from hf_blockpilot.training.oracle import OracleRecord
from hf_blockpilot.training.policy_training import (
    CostModel,
    PolicyTrainingConfig,
    evaluate_choices,
    objective_values,
    train_policy,
)

HIDDEN, LAYERS = 64, 4
CANDIDATES = [1, 4, 8]


def _records(n: int, seed: int = 0) -> list[OracleRecord]:
    """Synthetic prompts: a direction in feature space decides whether long blocks pay (τ grows with b) or not
    (τ(8) about τ(4))."""
    g = torch.Generator().manual_seed(seed)
    dim = 2 * 1 * HIDDEN + NUM_SCALAR_FEATURES
    rows = []
    for i in range(n):
        x = torch.randn(dim, generator=g)
        easy = bool(x[:32].sum() > 0)
        accept = 0.85 if easy else 0.25  # per slot: τ(b) = 1 + α + ... + α^(b-1)
        tau = {b: (1 - accept**b) / (1 - accept) for b in CANDIDATES}
        rows.append(OracleRecord(f"p{i}", "synthetic", 10, 50, tau, {b: 50 for b in CANDIDATES}, x.tolist()))
    return rows


def test_objectives_and_the_cost_model():
    record = _records(1)[0]
    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    assert objective_values(record, CANDIDATES, "acceptance", None) == [record.tau[b] for b in CANDIDATES]
    values = objective_values(record, CANDIDATES, "throughput", cost)
    assert values == pytest.approx([1000 * record.tau[1] / 50, 1000 * record.tau[4] / 110, 1000 * record.tau[8] / 140])
    with pytest.raises(ValueError, match="cost model"):
        objective_values(record, CANDIDATES, "throughput", None)
    # at T>0 a round of b also processes 2b - 1 vocabulary rows and makes b draws
    cost.sampling_process_ms, cost.sampling_draw_ms = 0.5, 2.0
    assert objective_values(record, CANDIDATES, "throughput", cost) == pytest.approx(values)
    hot = replace(record, temperature=1.0)
    assert objective_values(hot, CANDIDATES, "throughput", cost) == pytest.approx(
        [1000 * record.tau[1] / 52.5, 1000 * record.tau[4] / 121.5, 1000 * record.tau[8] / 163.5]
    )


def test_evaluate_choices_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    report = evaluate_choices(values, torch.tensor([2, 1]), CANDIDATES, "acceptance")
    assert report.accuracy == 0.5
    assert report.regret == pytest.approx(0.5)  # (0 + 1) / 2
    assert report.oracle_value == 3.0 and report.best_fixed_value == 2.0
    assert report.policy_value == pytest.approx(2.5)


@pytest.mark.parametrize("loss", ["regret", "ce"])
def test_policy_learns_the_per_prompt_choice(loss):
    target = make_target("qwen3", vocab_size=48, hidden_size=HIDDEN, layers=LAYERS)
    drafter = make_drafter(target)
    config = PolicyTrainingConfig(
        loss=loss, objective="throughput", epochs=400, patience=100, learning_rate=1e-2, dropout=0.0, width=16
    )
    # on this cost model hard prompts are fastest without speculation, easy ones with b=8
    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    policy, report = train_policy(_records(800), CANDIDATES, [1], target, drafter, config, cost)
    assert report.accuracy > 0.65, report  # a constant choice scores about 0.5 here
    assert report.policy_value > report.best_fixed_value, report
    assert report.oracle_counts[1] > 0 and report.oracle_counts[8] > 0
    assert policy.candidates == CANDIDATES and policy.objective == "throughput"


def test_cost_models_written_before_draws_were_timed_apart_load_as_they_were_charged():
    old = {"target_ms": {"1": 50.0, "4": 100.0}, "drafter_ms": {"4": 10.0}, "sampling_row_ms": 2.0}
    cost = CostModel.from_dict(old)
    assert (cost.sampling_process_ms, cost.sampling_draw_ms) == (2.0, 0.0)
    assert cost.round_ms(4, temperature=1.0) == pytest.approx(110.0 + 7 * 2.0)  # 2b - 1 rows, as before
    assert CostModel.from_dict(cost.to_dict()) == cost


def test_compare_objectives_shows_where_they_disagree():
    from hf_blockpilot.training.policy_training import compare_objectives

    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    result = compare_objectives(_records(200), CANDIDATES, cost)
    # acceptance never picks b=1 (τ(1) = 1 is the minimum); throughput does for the hard prompts
    assert result["acceptance"]["oracle_counts"][1] == 0
    assert result["throughput"]["oracle_counts"][1] > 0
    assert result["throughput"]["oracle_tokens_per_second"] > result["acceptance"]["oracle_tokens_per_second"]
    assert result["acceptance"]["oracle_tau"] >= result["throughput"]["oracle_tau"]


def test_policy_learns_a_temperature_dependent_choice():
    """Every prompt labelled at T=0 and T=1 (features equal but for the temperature): long blocks pay greedily,
    short ones when sampling. The split keeps a prompt's labels together; the report is also given per T."""
    from hf_blockpilot.training.policy_training import split_by_prompt

    records = []
    for r in _records(300):
        records.append(replace(r, tau={1: 1.0, 4: 3.0, 8: 6.0}, features=r.features[:-1] + [0.0]))
        records.append(replace(r, tau={1: 1.0, 4: 3.0, 8: 2.0}, features=r.features[:-1] + [1.0], temperature=1.0))
    train, held = split_by_prompt(records, 0.2, seed=0)
    assert not {r.id for r in train} & {r.id for r in held} and len(held) == 2 * 60
    target = make_target("qwen3", vocab_size=48, hidden_size=HIDDEN, layers=LAYERS)
    config = PolicyTrainingConfig(
        loss="ce", objective="throughput", epochs=300, patience=100, learning_rate=1e-2, dropout=0.0, width=16
    )
    cost = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    _, report = train_policy(records, CANDIDATES, [1], target, make_drafter(target), config, cost)
    cold, hot = report.by_temperature["0"], report.by_temperature["1"]
    assert cold["best_fixed_b"] == 8 and hot["best_fixed_b"] == 4
    assert cold["chosen"][8] > 0.9 * cold["validation_prompts"], cold
    assert hot["chosen"][4] > 0.9 * hot["validation_prompts"], hot
    assert report.policy_value > report.best_fixed_value  # no single b serves both temperatures


@pytest.mark.parametrize("tau_head", ["per_width", "per_slot"])
def test_a_tau_policy_learns_acceptance_and_prices_it_with_whichever_costs_it_is_given(tau_head):
    """Labels are τ(b) only (no machine in them). The trained policy predicts τ per prompt; priced with a steep
    cost model hard prompts decode plain, with a flat one (a wide verify about a plain step) they draft b = 4:
    one checkpoint, each machine's best width (its per-prompt oracle) for most prompts. Either head."""
    target = make_target("qwen3", vocab_size=48, hidden_size=HIDDEN, layers=LAYERS)
    config = PolicyTrainingConfig(epochs=400, patience=100, learning_rate=1e-2, dropout=0.0, width=16)
    assert config.objective == "tau" and config.tau_head == "per_width"  # the defaults
    config = replace(config, tau_head=tau_head)
    steep = CostModel(target_ms={1: 50.0, 4: 100.0, 8: 120.0}, drafter_ms={4: 10.0, 8: 20.0})
    flat = CostModel(target_ms={1: 50.0, 4: 50.0, 8: 60.0}, drafter_ms={4: 2.0, 8: 2.0})
    records = _records(800)
    policy, report = train_policy(records, CANDIDATES, [1], target, make_drafter(target), config, steep)
    assert policy.objective == "tau" and policy.weighs_costs and policy.training_loss == "tau-log-mse"
    assert policy.tau_head == tau_head
    tau = torch.tensor([[r.tau[b] for b in CANDIDATES[1:]] for r in records])
    constant_error = float(((tau.mean(0) - tau).abs() / tau).mean())  # predicting the mean τ(b) for every prompt
    assert report.tau_error < 0.6 * constant_error, (report, constant_error)
    assert report.accuracy > 0.65 and report.policy_value > report.best_fixed_value, report
    x = torch.tensor([r.features for r in records])
    with torch.no_grad():
        predicted = policy.predicted_tau(policy(x))
    full_tau = torch.tensor([[r.tau[b] for b in CANDIDATES] for r in records])
    choices = {}
    # the pricing rule itself, at the fixed minimum margin (served, this policy would also want its held-out τ
    # error as margin: `drafting_margin`)
    assert policy.drafting_margin() == pytest.approx(max(MIN_PREDICTED_GAIN, report.tau_error))
    for name, cost in (("steep", steep), ("flat", flat)):
        ms = torch.tensor([cost.round_ms(b) for b in CANDIDATES])
        choices[name] = policy.priced_choice(predicted, ms, MIN_PREDICTED_GAIN)
        oracle = policy.priced_choice(full_tau, ms, MIN_PREDICTED_GAIN)  # each prompt's best width, same rule
        assert (choices[name] == oracle).float().mean() > 0.8, name
    # where the hard prompts go differs between the machines: b = 1 against b = 4
    hard = torch.tensor([r.tau[8] < 2 for r in records])
    assert (choices["steep"][hard] == 0).float().mean() > 0.8 and (choices["flat"][hard] == 1).float().mean() > 0.7
    with pytest.raises(ValueError, match="leave the loss unset"):
        train_policy(records, CANDIDATES, [1], target, make_drafter(target), replace(config, loss="ce"), steep)
    with pytest.raises(ValueError, match="pass a cost model"):
        train_policy(records, CANDIDATES, [1], target, make_drafter(target), config, None)
