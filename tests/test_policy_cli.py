"""The policy pipeline from the command line on tiny checkpoints: collect -> train-policy -> evaluate-policy."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny_pair

from hf_blockpilot import BlockPilotPolicy
from hf_blockpilot.cli import main
from hf_blockpilot.data import chat_training_prompts, stdlib_training_prompts
from hf_blockpilot.training.oracle import read_oracle_labels


def test_collect_train_evaluate(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    labels = tmp_path / "labels"
    args = [
        "collect",
        *models,
        "--output-dir",
        str(labels),
        "--dataset",
        "stdlib",
        "--num-prompts",
        "12",
        "--candidates",
        "1",
        "3",
        "6",
        "--feature-layers",
        "1",
        "3",
        "--max-new-tokens",
        "16",
        "--verify",
        "2",
        "--temperatures",
        "0",
        "1",
    ]
    assert main(args) == 0
    assert main(args) == 0  # resumable: a rerun adds nothing
    records = read_oracle_labels(labels)
    assert len(records) == 24 and len({(r.id, r.temperature) for r in records}) == 24
    assert all(set(r.tau) == {1, 3, 6} and r.tau[1] == 1.0 for r in records)
    assert all(r.tau[6] >= 1.0 for r in records) and {r.temperature for r in records} == {0.0, 1.0}
    cold = {r.id: r.features for r in records if r.temperature == 0}
    for r in records:  # one prompt's features differ only in the temperature
        if r.temperature == 1:
            assert r.features[:-1] == pytest.approx(cold[r.id][:-1], abs=1e-5)
            assert (r.features[-1], cold[r.id][-1]) == (1.0, 0.0)
    manifest = json.loads((labels / "manifest.json").read_text())
    assert manifest["candidates"] == [1, 3, 6] and manifest["prompt_lookup"] is False
    # labels carry no machine by default: no cost model timed, no modeled times in the records
    assert not (labels / "cost_model.json").exists() and not any(r.ms for r in records)
    check = json.loads((labels / "replay_check.json").read_text())
    assert check["checked"] == 4 and check["equal"] == 4 and check["speedup"] > 0

    policy_dir = tmp_path / "policy"
    assert (
        main(
            [
                "train-policy",
                *models,
                "--labels",
                str(labels),
                "--output",
                str(tmp_path / "sub"),
                "--candidates",
                "3",
                "6",
            ]
        )
        == 0
    )
    assert BlockPilotPolicy.from_pretrained(tmp_path / "sub").candidates == [3, 6]
    assert main(["train-policy", *models, "--labels", str(labels), "--output", str(tmp_path / "sub")]) == 0
    assert "| candidate block sizes | 1, 3, 6 (1 = speculation off) |" in (tmp_path / "sub" / "README.md").read_text()
    assert main(["train-policy", *models, "--labels", str(labels), "--output", str(policy_dir)]) == 0
    policy = BlockPilotPolicy.from_pretrained(policy_dir)
    assert policy.candidates == [1, 3, 6] and policy.feature_layers == [1, 3]
    assert (policy_dir / "training_report.json").exists() and (policy_dir / "objectives.json").exists()
    assert policy.report["validation_prompts"] > 0  # kept in config.json, rendered on the card
    card = (policy_dir / "README.md").read_text()
    assert policy.prompt_lookup is False and "| prompt lookup | off |" in card and "prompt_lookup = True" not in card
    assert "accuracy vs per-prompt oracle b" in (policy_dir / "README.md").read_text()

    capsys.readouterr()
    out_json = tmp_path / "eval.json"
    assert (
        main(
            [
                "evaluate-policy",
                *models,
                "--policy",
                str(policy_dir),
                "--datasets",
                "humaneval",
                "--limit",
                "2",
                "--max-new-tokens",
                "8",
                "--output",
                str(out_json),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for method in ("plain", "b=3", "b=6", "policy", "oracle"):
        assert f"| {method} |" in table
    summary = json.loads(out_json.read_text())["humaneval"]["summary"]
    assert all(row["mismatches"] == 0 for row in summary.values())


def test_collect_shards_over_processes(tmp_path, monkeypatch):
    """Two processes (RANK/WORLD_SIZE as `accelerate launch` sets them) split the prompts without overlap."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    args = [
        "collect",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "labels"),
        "--num-prompts",
        "7",
        "--candidates",
        "1",
        "4",
        "--feature-layers",
        "1",
        "--max-new-tokens",
        "8",
        "--no-cost-model",
        "--temperatures",
        "0",
    ]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(args) == 0
    shards = [[json.loads(line)["id"] for line in (tmp_path / "labels" / f"labels-00{r}.jsonl").open()] for r in (0, 1)]
    assert len(shards[0]) == 4 and len(shards[1]) == 3
    assert not set(shards[0]) & set(shards[1])
    assert len(read_oracle_labels(tmp_path / "labels")) == 7


def test_measure_cost_and_train_policy_with_a_cost_model_from_another_device(tmp_path, capsys):
    """`measure-cost` writes a cost model; `train-policy --cost-model` scores the labels with it instead."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    labels = tmp_path / "labels"
    assert (
        main(
            [
                "collect",
                *models,
                "--output-dir",
                str(labels),
                "--num-prompts",
                "10",
                "--candidates",
                "1",
                "3",
                "6",
                "--feature-layers",
                "1",
                "--max-new-tokens",
                "12",
                "--no-cost-model",
                "--temperatures",
                "0",
            ]
        )
        == 0
    )
    assert not (labels / "cost_model.json").exists()

    measured = tmp_path / "cost.json"
    assert main(["measure-cost", *models, "--output", str(measured), "--candidates", "3", "6", "--repeats", "2"]) == 0
    cost = json.loads(measured.read_text())
    assert set(cost["target_ms"]) == {"1", "3", "6"} and set(cost["drafter_ms"]) == {"3", "6"}
    assert cost["device"] == "cpu" and all(ms > 0 for ms in cost["target_ms"].values())
    assert "b=6: round" in capsys.readouterr().out

    # a device where a 6-token round is nearly free: every prompt's throughput oracle becomes b = 6
    fake = {
        **cost,
        "device": "fake-gpu",
        "target_ms": {"1": 30.0, "3": 30.0, "6": 1e-3},
        "drafter_ms": {"3": 1.0, "6": 1e-3},
    }
    (tmp_path / "fake.json").write_text(json.dumps(fake))
    out = tmp_path / "policy"
    assert (
        main(
            [
                "train-policy",
                *models,
                "--labels",
                str(labels),
                "--output",
                str(out),
                "--cost-model",
                str(tmp_path / "fake.json"),
            ]
        )
        == 0
    )
    report = json.loads((out / "training_report.json").read_text())
    assert report["cost_model_device"] == "fake-gpu" and report["best_fixed_b"] == 6
    assert (
        set(report["oracle_counts"]) == {"1", "3", "6"} and report["oracle_counts"]["6"] == report["validation_prompts"]
    )
    assert "round latencies measured on fake-gpu" in (out / "README.md").read_text()

    capsys.readouterr()
    assert (
        main(
            [
                "train-policy",
                *models,
                "--labels",
                str(labels),
                "--output",
                str(out),
                "--cost-model",
                str(tmp_path / "no.json"),
            ]
        )
        == 2
    )
    assert "hf-blockpilot measure-cost --output" in capsys.readouterr().err
    (tmp_path / "partial.json").write_text(json.dumps({**fake, "target_ms": {"1": 30.0, "3": 30.0}}))
    partial = ["train-policy", *models, "--labels", str(labels), "--output", str(out)]
    assert main([*partial, "--cost-model", str(tmp_path / "partial.json")]) == 2  # bad input: exit 2, one line
    assert "no latency for block sizes [6]" in capsys.readouterr().err


def test_a_policy_trained_on_prompt_lookup_labels_records_it(tmp_path):
    """`collect --prompt-lookup` labels decoding with lookup; `train-policy` records that in the policy and card."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    labels = tmp_path / "labels"
    assert (
        main(
            [
                "collect",
                *models,
                "--prompt-lookup",
                "--output-dir",
                str(labels),
                "--num-prompts",
                "10",
                "--candidates",
                "1",
                "4",
                "--feature-layers",
                "1",
                "--max-new-tokens",
                "12",
                "--no-cost-model",
                "--temperatures",
                "0",
            ]
        )
        == 0
    )
    out = tmp_path / "policy"
    assert (
        main(["train-policy", *models, "--labels", str(labels), "--output", str(out), "--objective", "acceptance"]) == 0
    )
    assert BlockPilotPolicy.from_pretrained(out).prompt_lookup is True
    card = (out / "README.md").read_text()
    assert "| prompt lookup | on (labels collected with `--prompt-lookup`" in card
    assert "drafter.prompt_lookup = True" in card


def test_composed_labels_under_the_adaptive_controller(tmp_path, capsys):
    """collect records rounds and modeled times; train-policy fits the acceptance model into the policy; a second
    collect labels the drafting width *with* AdaptiveVerify (that model) cutting each round."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    common = [
        "--dataset",
        "stdlib",
        "--num-prompts",
        "6",
        "--candidates",
        "1",
        "3",
        "6",
        "--feature-layers",
        "1",
        "3",
        "--max-new-tokens",
        "16",
        "--temperatures",
        "0",
        "1",
    ]
    assert main(["collect", *models, "--output-dir", str(tmp_path / "fixed"), *common, "--cost-model"]) == 0
    fixed = read_oracle_labels(tmp_path / "fixed")
    assert all(r.controller == "fixed" and set(r.ms) == {1, 3, 6} and r.slot_rows for r in fixed)
    assert main(["train-policy", *models, "--labels", str(tmp_path / "fixed"), "--output", str(tmp_path / "p1")]) == 0
    first = BlockPilotPolicy.from_pretrained(tmp_path / "p1")
    assert first.acceptance_model is not None and first.cost_model is not None
    assert (tmp_path / "p1" / "acceptance_model.json").is_file()
    assert "calibrated acceptance" in (tmp_path / "p1" / "README.md").read_text()

    # --adaptive needs the cost model: a one-line error before any model loads
    assert (
        main(["collect", *models, "--output-dir", str(tmp_path / "x"), *common, "--adaptive", "--no-cost-model"]) == 2
    )
    assert (
        main(
            [
                "collect",
                *models,
                "--output-dir",
                str(tmp_path / "adaptive"),
                *common,
                "--adaptive",
                "--acceptance-model",
                str(tmp_path / "p1"),
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "adaptive" / "manifest.json").read_text())
    assert manifest["controller"] == "adaptive" and manifest["acceptance_model"] == first.acceptance_model.to_dict()
    composed = read_oracle_labels(tmp_path / "adaptive")
    assert all(r.controller == "adaptive" and set(r.ms) == {1, 3, 6} for r in composed)
    assert (
        main(
            [
                "train-policy",
                *models,
                "--labels",
                str(tmp_path / "adaptive"),
                "--output",
                str(tmp_path / "p2"),
                "--acceptance-model",
                str(tmp_path / "p1" / "acceptance_model.json"),
                "--objective",
                "throughput",
            ]
        )
        == 0
    )
    # the τ objective learns fully verified rounds only: composed labels are refused with the fix named
    tau = ["train-policy", *models, "--labels", str(tmp_path / "adaptive"), "--output", str(tmp_path / "p3")]
    assert main(tau) == 2
    assert "collect the labels without --adaptive" in capsys.readouterr().err
    assert BlockPilotPolicy.from_pretrained(tmp_path / "p2").acceptance_model == first.acceptance_model


def test_collect_short_and_multi_turn_prompts(tmp_path):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    args = ["--num-prompts", "2", "--candidates", "1", "3", "--feature-layers", "1", "3", "--temperatures", "0"]
    labels = tmp_path / "labels"
    command = ["collect", *models, "--output-dir", str(labels), "--dataset", "short", "multiturn", *args]
    assert main([*command, "--max-new-tokens", "6"]) == 0
    records = read_oracle_labels(labels)
    assert [r.dataset for r in records] == ["short", "short", "multiturn", "multiturn"]
    # follow-ups to a chat and a code request (drawn with the next seed), whose prompts hold that first request
    firsts = [chat_training_prompts(1, seed=2)[0], stdlib_training_prompts(1, seed=2)[0]]
    assert [r.id for r in records[2:]] == [f"multiturn/{first.id}" for first in firsts]
    assert all(r.prompt_tokens > len(first.prompt) + 1 for r, first in zip(records[2:], firsts, strict=True))
    answered = [json.loads(line)["id"] for line in (labels / "first-turns" / "responses.jsonl").open()]
    assert sorted(answered) == sorted(first.id for first in firsts)  # kept for a rerun
