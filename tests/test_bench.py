"""The benchmark harness end to end on tiny random checkpoints (seconds; no speed assertions)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from conftest import save_tiny_pair

from hf_blockpilot._compat import decode_dtypes
from hf_blockpilot.cli import main
from hf_blockpilot.data import chat_inputs, load_prompts


def other_plains() -> set[str]:
    """The bench's plain methods in the other dtypes decoding may be fastest in on CPU."""
    return {f"plain {str(d).removeprefix('torch.')}" for d in decode_dtypes("cpu") if d != torch.float32}


def test_bench_writes_json_markdown_and_plots(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--datasets",
            "humaneval",
            "gsm8k",
            "--limit",
            "2",
            "--block-sizes",
            "2",
            "4",
            "--temperatures",
            "0",
            "1",
            "--max-new-tokens",
            "6",
            "--repeats",
            "2",
            "--output-dir",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch"] and report["machine"]["cpu"]
    assert report["machine"]["dtype"] == "float32" and isinstance(report["machine"]["device_flags"], list)
    assert report["settings"]["cost_model_source"].startswith("shipped fallback")  # calibration is off in tests
    assert [(r["dataset"], r["temperature"]) for r in report["runs"]] == [
        ("humaneval", 0.0),
        ("gsm8k", 0.0),
        ("humaneval", 1.0),
        ("gsm8k", 1.0),
    ]
    baselines = {"heuristic", "ema", "entropy", "adaptive"}  # the per-round controllers, beside the fixed sizes
    assert set(report["settings"]["controllers"]) == baselines
    for run in report["runs"]:
        assert set(run["summary"]) == {"plain", "b=2", "b=4", "default", "oracle"} | baselines | other_plains()
        # prompts x (plain, in each native dtype + 2 fixed sizes + the default + 4 controllers)
        assert len(run["results"]) == 2 * (8 + len(other_plains()))
        fastest = max(run["summary"][m]["tokens_per_second"] for m in {"plain"} | other_plains())
        assert run["summary"]["b=2"]["speedup_vs_fastest_plain"] == pytest.approx(
            run["summary"]["b=2"]["tokens_per_second"] / fastest
        )
        assert run["summary"]["plain"]["speedup"] == 1.0
        assert 0 < run["summary"]["b=4"]["verified_per_round"] <= 3
        adaptive = [r for r in run["results"] if r["method"] == "adaptive"]
        pooled = sum(r["verified_drafts"] for r in adaptive) / max(sum(r["draft_rounds"] for r in adaptive), 1)
        assert run["summary"]["adaptive"]["verified_per_round"] == pytest.approx(pooled)
        assert all(r["verified_drafts"] <= r["drafted_slots"] for r in adaptive)  # it verifies a prefix of its drafts
        if run["temperature"] == 0:  # plain in another dtype is not compared (other numbers, other outputs)
            assert all(r["identical_to_plain"] for r in run["results"] if r["method"] not in other_plains())
    table = (out / "results.md").read_text()
    assert "### humaneval, T=0" in table and "| b=4 |" in table and "| adaptive |" in table
    assert "per-round decision overhead" in table
    # the rounds also on the shipped CPU cost model: every method modeled, the round oracle for each fixed b
    assert report["settings"]["cost_model"]["device"] == "cpu"
    greedy = report["runs"][0]["summary"]
    assert all(row["modeled_speedup"] > 0 for row in greedy.values())
    assert {m for m, row in greedy.items() if "round_oracle_speedup" in row} == {"b=2", "b=4"}
    assert all(greedy[m]["round_oracle_speedup"] >= greedy[m]["modeled_speedup"] for m in ("b=2", "b=4"))
    assert not any("round_oracle_speedup" in row for row in report["runs"][2]["summary"].values())  # T = 1
    assert "per-round oracle, modeled" in table
    for name in ("speedup.png", "block_sizes.png", "tau.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| oracle |" in capsys.readouterr().out


def test_bench_with_prompt_lookup_records_it(tmp_path):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--datasets",
            "humaneval",
            "--limit",
            "2",
            "--block-sizes",
            "4",
            "--temperatures",
            "0",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--prompt-lookup",
            "--no-baselines",
            "--output-dir",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert report["settings"]["prompt_lookup"] is True
    assert set(report["runs"][0]["summary"]) == {"plain", "b=4", "default", "oracle"} | other_plains()
    assert all(r["identical_to_plain"] for r in report["runs"][0]["results"] if r["method"] not in other_plains())
    assert "Prompt lookup on" in (out / "results.md").read_text()


def test_bench_times_the_reference_loop_beside_ours(tmp_path, capsys):
    import pytest

    pytest.importorskip("dflash.model", reason="the reference package: pip install --no-deps dflash==0.1.0")
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--datasets",
            "humaneval",
            "--limit",
            "2",
            "--block-sizes",
            "2",
            "4",
            "--temperatures",
            "0",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--no-baselines",
            "--prompt-lookup",
            "--reference",
            "--output-dir",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    (run,) = report["reference"]
    assert {(r["block_size"], r["method"]) for r in run["summary"]} == {
        (b, side) for b in (2, 4) for side in ("hf-blockpilot", "dflash-reference")
    }
    assert len(run["results"]) == 2 * 2 * 2 and all(r["identical_to_plain"] for r in run["results"])
    assert "ours vs the reference loop" in (out / "results.md").read_text()
    assert "| 2 | dflash-reference |" in capsys.readouterr().out


def test_bench_reference_without_the_package_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import sys

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    monkeypatch.setitem(sys.modules, "dflash.model", None)  # as if not installed
    code = main(
        [
            "bench",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--datasets",
            "humaneval",
            "--limit",
            "1",
            "--block-sizes",
            "2",
            "--reference",
            "--output-dir",
            str(tmp_path / "bench"),
        ]
    )
    assert code == 2 and "pip install --no-deps dflash==0.1.0" in capsys.readouterr().err
    assert not (tmp_path / "bench" / "results.json").exists()  # failed before decoding anything


def test_bench_cost_model_file_is_used_and_a_missing_one_fails_first(tmp_path, capsys):
    import pytest

    from hf_blockpilot.costs import CostModel

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    common = [
        "bench",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--device",
        "cpu",
        "--datasets",
        "humaneval",
        "--limit",
        "1",
        "--block-sizes",
        "2",
        "--temperatures",
        "0",
        "--max-new-tokens",
        "4",
        "--repeats",
        "1",
    ]
    code = main(common + ["--cost-model", str(tmp_path / "absent.json"), "--output-dir", str(tmp_path / "none")])
    assert code == 2 and "hf-blockpilot measure-cost" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # failed before loading or decoding anything
    cost = CostModel(target_ms={1: 7.0, 2: 9.0, 16: 30.0}, drafter_ms={2: 1.0, 16: 5.0}, device="my-device")
    cost.save(tmp_path / "cost.json")
    assert main(common + ["--cost-model", str(tmp_path / "cost.json"), "--output-dir", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "results.json").read_text())
    assert CostModel.from_dict(report["settings"]["cost_model"]) == cost
    (plain,) = [r for r in report["runs"][0]["results"] if r["method"] == "plain"]
    assert plain["modeled_seconds"] == pytest.approx(plain["new_tokens"] * 7.0 / 1000)  # on the file's clock


def test_batch_benchmark_times_plain_and_ours_per_batch_size(tmp_path):
    from hf_blockpilot.tools.batch_bench import run_batch_benchmark
    from hf_blockpilot.tools.loading import resolve_drafter, resolve_target

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    target, tokenizer = resolve_target(target_dir)
    drafter = resolve_drafter(drafter_dir)
    out = tmp_path / "batch"
    report = run_batch_benchmark(
        target, tokenizer, drafter, ["humaneval"], [1, 3], limit=4, max_new_tokens=6, output_dir=out
    )
    assert report["machine"]["device"] == "cpu" and report["settings"]["batch_sizes"] == [1, 3]
    assert report["settings"]["controller"] and report["settings"]["pad_token_id"] == 0
    assert [(r["dataset"], r["temperature"], r["batch_size"]) for r in report["runs"]] == [
        ("humaneval", 0.0, 1),
        ("humaneval", 0.0, 3),
    ]
    for run, sizes in zip(report["runs"], ([1, 1, 1, 1], [3, 1])):  # the last batch holds the rest
        assert [b["rows"] for b in run["per_batch"]] == sizes and run["batches"] == len(sizes)
        assert run["prompts"] == 4 and run["mismatches"] == 0
        assert run["plain_tokens"] == run["ours_tokens"] == 4 * 6  # the tiny target has no EOS: every row runs out
        assert run["plain_tokens_per_second"] > 0 and run["ours_tokens_per_second"] > 0
        assert run["speedup"] == pytest.approx(run["ours_tokens_per_second"] / run["plain_tokens_per_second"])
        # plain also in every other native dtype: the fastest of them is what ours is compared with too
        by_dtype = run["plain_tokens_per_second_by_dtype"]
        assert set(by_dtype) == {"float32"} | {name.removeprefix("plain ") for name in other_plains()}
        assert by_dtype["float32"] == pytest.approx(run["plain_tokens_per_second"])
        assert run["fastest_plain"] == max(by_dtype, key=by_dtype.get)
        assert run["speedup_vs_fastest_plain"] == pytest.approx(run["ours_tokens_per_second"] / max(by_dtype.values()))
        assert run["tau"] > 0 and 0 <= run["padded_share"] < 1
        assert 0 <= run["padded_slots"] <= run["verify_slots"] and run["verify_slots"] > 0
    assert report["runs"][0]["padded_slots"] == 0  # one row per call: nothing to pad
    assert json.loads((out / "results.json").read_text()) == report
    table = (out / "results.md").read_text()
    assert "| humaneval | 0 | 3 | float32 | 2 |" in table
    assert "greedy mismatches" in table and "vs fastest plain" in table
    assert (out / "throughput_vs_batch.png").read_bytes()[:4] == b"\x89PNG"


def test_batch_benchmark_decodes_each_batch_size_in_the_dtype_chosen_for_it(tmp_path):
    """`bench --batch-size --dtype auto`: both sides of each batch size run in the dtype `choose_dtype` gives for it
    (copies of the pair), greedy rows identical to plain decoding in that dtype."""
    from hf_blockpilot.tools.batch_bench import run_batch_benchmark
    from hf_blockpilot.tools.loading import resolve_drafter, resolve_target

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    target, tokenizer = resolve_target(target_dir)
    drafter = resolve_drafter(drafter_dir)
    asked = []

    def choose(target, drafter, batch_size, prompt_tokens, new_tokens):
        asked.append((next(target.parameters()).dtype, batch_size, prompt_tokens, new_tokens))
        return torch.bfloat16 if batch_size > 1 else torch.float32

    report = run_batch_benchmark(
        target, tokenizer, drafter, ["humaneval"], [1, 2], limit=2, max_new_tokens=4, choose_dtype=choose
    )
    # asked of the pair as given, with the batches' median padded prompt length and the new tokens
    lengths = [len(chat_inputs(tokenizer, record.prompt, "cpu")[0]) for record in load_prompts("humaneval", 2)]
    assert asked == [
        (torch.float32, 1, int(statistics.median(lengths)), 4),
        (torch.float32, 2, max(lengths), 4),
    ]
    assert [(r["batch_size"], r["dtype"]) for r in report["runs"]] == [(1, "float32"), (2, "bfloat16")]
    assert all(r["mismatches"] == 0 for r in report["runs"])
    assert next(target.parameters()).dtype == torch.float32  # the caller's pair is left as it was
    assert "float32" in report["runs"][1]["plain_tokens_per_second_by_dtype"]  # plain timed in the other dtype too


def test_batch_rows_are_left_padded_and_counted_up_to_their_eos():
    import torch
    from conftest import char_tokenizer

    from hf_blockpilot.data import chat_batch, chat_inputs
    from hf_blockpilot.tools.batch_bench import row_tokens

    tokenizer = char_tokenizer(48)
    batch = chat_batch(tokenizer, ["abc", "a"], "cpu")
    short = chat_inputs(tokenizer, "a", "cpu")[0]
    assert torch.equal(batch["input_ids"][0], chat_inputs(tokenizer, "abc", "cpu")[0])
    assert torch.equal(batch["input_ids"][1, -len(short) :], short)  # the same formatting, padded on the left
    assert batch["attention_mask"][1].tolist() == [0, 0] + [1] * len(short)
    tokenizer.pad_token = None  # no pad token: padded with the id given
    unpadded = chat_batch(tokenizer, ["abc", "a"], "cpu", pad_token_id=0)
    assert torch.equal(unpadded["input_ids"], batch["input_ids"])
    assert torch.equal(unpadded["attention_mask"], batch["attention_mask"])
    sequences = torch.tensor([[9, 9, 5, 2, 7, 0], [9, 9, 5, 6, 7, 8]])
    assert row_tokens(sequences, 2, {2}) == [[5, 2], [5, 6, 7, 8]]  # EOS kept, the padding after it not
    assert row_tokens(sequences, 2, set()) == [[5, 2, 7, 0], [5, 6, 7, 8]]


def test_bench_batch_size_mode_from_the_command_line(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    out = tmp_path / "batch"
    common = ["bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    common += ["--datasets", "gsm8k", "--limit", "3", "--max-new-tokens", "5"]
    code = main(
        common + ["--batch-size", "3", "1", "--temperatures", "0", "1", "--repeats", "1", "--output-dir", str(out)]
    )
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert [(r["temperature"], r["batch_size"]) for r in report["runs"]] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert [r["mismatches"] for r in report["runs"]] == [0, 0, None, None]  # compared at T = 0 only
    assert report["settings"]["repeats"] == 1 and not (out / "speedup.png").exists()  # not the per-prompt bench
    printed = capsys.readouterr().out
    assert "| gsm8k | 0 | 3 | float32 | 1 |" in printed and "| gsm8k | 1 | 3 | float32 | 1 |" in printed
    assert "| n/a |" in printed
    code = main(common + ["--batch-size", "2", "--reference", "--output-dir", str(tmp_path / "none")])
    assert code == 2 and "--batch-size runs the batch-size benchmark, which does not take --reference" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "none").exists()  # failed before loading or decoding anything
