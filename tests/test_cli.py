"""Smoke tests of the `hf-blockpilot` command line and the end-to-end drafter recipe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import make_target, save_tiny_pair

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.cli import build_parser, main
from hf_blockpilot.training.data import RESPONSES_FILE, read_sequences
from hf_blockpilot.training.drafter import DrafterTrainingConfig, train_drafter


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "hf_blockpilot", "--help"], capture_output=True, text=True, check=True)
    for command in ("generate", "train-drafter", "eval-drafter"):
        assert command in out.stdout


@pytest.mark.slow
def test_generate_command_on_the_real_default_target(tmp_path, capsys):
    """`generate --compare` on SmolLM2 (converted from the GGUF package) with a drafter given by directory."""
    pytest.importorskip("gguf", reason="the embedded default target needs the `gguf` package")
    from hf_blockpilot.tools.loading import load_default_target

    try:
        target, _ = load_default_target()
    except FileNotFoundError as err:
        pytest.skip(f"embedded default target unavailable: {err}")
    drafter_dir = tmp_path / "drafter"
    BlockDiffusionDrafter.from_target(target, block_size=4).save_pretrained(drafter_dir)
    code = main(
        [
            "generate",
            "Say hi.",
            "--drafter",
            str(drafter_dir),
            "--max-new-tokens",
            "12",
            "--compare",
            "--no-stream",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert result["identical_to_plain"] is True
    assert result["block_size"] == 4 and result["new_tokens"] >= 1 and result["speedup"] > 0


def test_generate_command_with_prompt_lookup(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    args = [
        "generate",
        "abcabcabcabc",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--device",
        "cpu",
        "--max-new-tokens",
        "24",
        "--block-size",
        "4",
        "--compare",
        "--no-stream",
        "--json",
    ]
    assert main(args) == 0
    without = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "lookup_rounds" not in without
    assert main([*args, "--prompt-lookup"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_to_plain"] is True and result["block_size"] == 4
    assert result["lookup_rounds"] > 0 and result["new_tokens"] == without["new_tokens"]


def test_train_drafter_recipe_end_to_end(tmp_path):
    """Responses on disk -> hidden-state cache -> training -> z-lab checkpoint, and a resume that continues."""
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    with (data / RESPONSES_FILE).open("w") as f:
        for i in range(5):
            prompt = torch.randint(3, 48, (6,), generator=g).tolist()
            response = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 6:].tolist()
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": prompt, "response_ids": response}) + "\n")
    assert len(read_sequences(data)) == 5
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=4,
        sequences_per_step=2,
        max_steps=6,
        warmup_steps=2,
        save_every=3,
        log_every=3,
        bf16=False,
    )
    drafter = train_drafter(target, None, tmp_path / "run", num_layers=1, draft_vocab_size=32, config=cfg)
    distinct = {t for seq in read_sequences(data) for t in seq.input_ids[seq.response_start :]}
    assert len(distinct) < 32  # fewer distinct response tokens than asked for: padded with the lowest free ids
    padding = [i for i in range(48) if i not in distinct][: 32 - len(distinct)]
    assert drafter.d2t.tolist() == sorted(distinct | set(padding))
    saved = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["block_size"] == 4
    cfg.max_steps = 9
    again = train_drafter(target, None, tmp_path / "run", config=cfg, refresh_draft_vocab=True)
    assert again.d2t.tolist() == drafter.d2t.tolist()  # rebuilt from the same data: the same vocabulary
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [3, 6, 9]
    prompt = torch.tensor([[5, 6, 7]])
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=again), expected)

    # fine-tuning: a new run starts from the trained drafter's weights (not from the target), with its own step count
    (tmp_path / "tuned" / "data").mkdir(parents=True)
    (tmp_path / "tuned" / "data" / RESPONSES_FILE).write_text((data / RESPONSES_FILE).read_text())
    cfg.max_steps, cfg.learning_rate, cfg.log_every = 2, 1e-12, 1
    tuned = train_drafter(target, None, tmp_path / "tuned", config=cfg, init_drafter=tmp_path / "run" / "checkpoint")
    for (name, p), q in zip(again.state_dict().items(), tuned.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    log = [json.loads(line) for line in (tmp_path / "tuned" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1, 2]


def test_train_drafter_command_answers_a_prompt_file_and_trains_without_a_cache(tmp_path):
    """`train-drafter --prompts-file ... --no-hidden-cache`: the target answers the file's prompts, and
    training reads hidden states straight from the target (the GPU recipe), leaving no cache on disk."""
    target_dir, _ = save_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"mine/{i}", "prompt": text}) + "\n" for i, text in enumerate(["abc", "hello", "Zebra"])
        )
    )
    run = tmp_path / "run"
    code = main(
        [
            "train-drafter",
            "--target",
            str(target_dir),
            "--output-dir",
            str(run),
            "--num-prompts",
            "0",
            "--chat-prompts",
            "0",
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--block-size",
            "4",
            "--draft-vocab-size",
            "0",
            "--max-steps",
            "4",
            "--warmup-steps",
            "1",
            "--anchors",
            "4",
            "--sequences-per-step",
            "3",
            "--validation-fraction",
            "0",
            "--no-hidden-cache",
            "--generation-batch-size",
            "2",
        ]
    )
    assert code == 0
    assert [seq.id for seq in read_sequences(run / "data")] == ["mine/0", "mine/1", "mine/2"]
    assert (run / "checkpoint" / "model.safetensors").exists() and not (run / "hidden").exists()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "must be >= 0"),
        ("--max-new-tokens", "0", "must be a positive integer"),
        ("--device", "gpu", "not a torch device: 'gpu'"),
        ("--block-size", "1", "block size must be an int in 2..256"),
        ("--block-size", "10000", "block size must be an int in 2..256"),
        ("--max-slowdown", "2", "max_slowdown must be in (0, 1)"),
        ("--max-slowdown", "0", "max_slowdown must be in (0, 1)"),
    ],
)
def test_out_of_range_arguments_are_usage_errors(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_max_slowdown_bounds_the_default_and_is_refused_with_other_controllers(tmp_path, capsys, monkeypatch):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    pair = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "6", "--no-stream"]
    assert main(["generate", "abcabc", *pair, "--json", "--compare", "--max-slowdown", "0.05"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["controller"].endswith(", max_slowdown=0.05)") and result["identical_to_plain"] is True
    from hf_blockpilot.tools import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the controller choice was checked")

    monkeypatch.setattr(loading, "resolve_target", no_loading)
    assert main(["generate", "abcabc", *pair, "--controller", "fixed", "--max-slowdown", "0.05"]) == 2
    assert "--max-slowdown bounds the default controller's guard" in capsys.readouterr().err


def test_eval_drafter_by_replay(tmp_path, capsys):
    """`--replay` prints τ per width, keeps the target's answers for reuse, and refuses a card (a card states
    real-decoding figures, checked against plain `generate`)."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    common = ["eval-drafter", "--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    common += ["--datasets", "humaneval", "--limit", "2", "--block-sizes", "2", "4", "--max-new-tokens", "6"]
    answers = tmp_path / "answers"
    assert main([*common, "--replay", "--responses-dir", str(answers), "--output", str(tmp_path / "r.json")]) == 0
    assert "humaneval (2 prompts): b=2: τ=" in capsys.readouterr().out
    (report,) = json.loads((tmp_path / "r.json").read_text())
    assert set(report["tau"]) == {"2", "4"} and all(1.0 <= tau <= 4.0 for tau in report["tau"].values())
    assert (answers / "humaneval-6" / "responses.jsonl").read_text().count("\n") == 2
    assert main([*common, "--replay", "--card", str(tmp_path / "card.md")]) == 2
    assert "drop --prompt-lookup and --card" in capsys.readouterr().err


def test_a_missing_drafter_directory_fails_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from hf_blockpilot.tools import loading as defaults

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the sources were checked")

    monkeypatch.setattr(defaults, "resolve_target", no_loading)
    missing = tmp_path / "drafter"
    assert main(["eval-drafter", "--drafter", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"hf-blockpilot eval-drafter: error: drafter '{missing}': no such directory" in err
    assert "Traceback" not in err and "HF_BLOCKPILOT_DEBUG=1" in err
    monkeypatch.setenv("HF_BLOCKPILOT_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["eval-drafter", "--drafter", str(missing)])


def test_block_size_lists_are_sorted_and_distinct():
    assert build_parser().parse_args(["bench", "--block-sizes", "8", "4", "8"]).block_sizes == [4, 8]
    assert build_parser().parse_args(["collect", "--output-dir", "x", "--candidates", "4", "1", "4"]).candidates == [
        1,
        4,
    ]


def test_train_policy_without_labels_says_to_collect_them(tmp_path, capsys, monkeypatch):
    from hf_blockpilot.tools import loading as defaults

    monkeypatch.setattr(defaults, "resolve_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["train-policy", "--labels", str(tmp_path / "labels"), "--output", str(tmp_path / "policy")]) == 2
    assert f"hf-blockpilot collect --output-dir {tmp_path / 'labels'}" in capsys.readouterr().err


def test_env_reports_versions_and_the_embedded_assets(tmp_path, capsys, monkeypatch):
    import hf_blockpilot

    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path))
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hf-blockpilot"] == hf_blockpilot.__version__ and report["torch"] == torch.__version__
    assert report["embedded drafter"] == report["embedded policy"] == "present"
    assert (
        report["default target"] == f"not converted yet (first use converts it): {tmp_path / 'SmolLM2-135M-Instruct'}"
    )
    assert main(["env"]) == 0
    assert f"- transformers: {report['transformers']}" in capsys.readouterr().out.splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--device", "cuda"])
    assert (
        "argument --device: cuda: this torch build or machine has no CUDA; use --device cpu" in capsys.readouterr().err
    )


def test_stdout_carries_only_the_answer_and_the_results(tmp_path, capsys):
    """Loading a policy from a directory printed "Loading weights from local directory" into stdout (and into
    --json output); stdout is the answer and the results line, or the answer and the JSON record."""
    from hf_blockpilot.policy import PrefillMLPPolicy

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    PrefillMLPPolicy(
        candidates=[2, 4], feature_layers=[1], target_hidden_size=64, target_vocab_size=48, target_num_layers=4
    ).save_pretrained(tmp_path / "policy")
    args = [
        "generate",
        "abcabc",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--device",
        "cpu",
        "--max-new-tokens",
        "8",
        "--policy",
        str(tmp_path / "policy"),
        "--no-stream",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Loading weights" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    # a policy of fully verified labels serves as generate() serves it by default: every draft verified, guarded
    assert lines[-2].startswith("device: ") and "controller: guarded(policy)" in lines[-2] and "tau:" in lines[-2]
    assert lines[-1].startswith(("rounds (drafts verified/accepted):", "rounds: none drafted"))
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.out and "controller: guarded(policy)" in captured.err
    record = json.loads(captured.out.strip().splitlines()[-1])
    drafted = any(verified for verified, _ in record["verified_and_accepted_per_round"])
    assert ("rounds: none drafted" in captured.err) == (not drafted) == ("none drafted" in lines[-1])
    assert len(record["verified_and_accepted_per_round"]) == record["new_tokens"] - sum(
        a for _, a in record["verified_and_accepted_per_round"]
    )


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_damaged_weights_file_is_a_one_line_error(tmp_path, capsys, damage):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    weights = drafter_dir / "model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:200])
    code = main(
        [
            "generate",
            "abc",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--max-new-tokens",
            "4",
            "--no-stream",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "could not load the drafter" in err and "weights file is damaged" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "caf\udce9"], "the prompt is not valid UTF-8 text"),
        (["generate", "hi", "--temperature", "inf"], "must be a finite number"),
        (["generate", "hi", "--temperature", "nan"], "must be a finite number"),
    ],
)
def test_undecodable_prompts_and_infinite_temperatures_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("controller", ["adaptive", "fixed", "heuristic", "ema", "entropy"])
def test_every_controller_choice_generates_without_a_policy(tmp_path, capsys, controller):
    """`--controller fixed` on a pair without a policy built its controller from a name only imported for type
    checkers (a NameError); every choice now runs and says which controller decided."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    code = main(
        [
            "generate",
            "abcabc",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--device",
            "cpu",
            "--max-new-tokens",
            "6",
            "--no-stream",
            "--controller",
            controller,
            "--block-size",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"controller: {controller}(" in out


def test_calibrate_measures_once_then_reads_the_cache(tmp_path, capsys, monkeypatch):
    from hf_blockpilot.device_calibration import forget_resolved

    monkeypatch.setenv("HF_BLOCKPILOT_CALIBRATE", "1")
    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path / "cache"))
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    args = ["calibrate", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dtype", "float32"]
    assert main([*args, "--max-width", "4"]) == 0
    first = capsys.readouterr().out
    assert "target ms" in first and "plain steps" in first and "verify forwards probed exact: yes" in first
    assert "measured in" in first and str(tmp_path / "cache" / "calibration") in first
    assert main(args) == 0
    assert "read from the cache" in capsys.readouterr().out
    assert main([*args, "--force"]) == 0
    assert "measured in" in capsys.readouterr().out
    forget_resolved()


def test_generate_reports_device_dtype_and_cost_source_and_times_both_sides_alike(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    args = [
        "generate",
        "abcabc",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--max-new-tokens",
        "6",
        "--no-stream",
        "--json",
        "--compare",
        "--repeats",
        "2",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == "float32" and result["device"]  # calibration off in tests: auto keeps float32
    assert result["costs"].startswith("shipped fallback") and result["controller"].startswith("guarded(")
    assert result["timed_runs"].startswith("2 per side, back to back") and result["identical_to_plain"] is True


def test_auto_dtype_is_chosen_for_the_prompt_and_answer_length_asked(tmp_path, capsys, monkeypatch):
    """`generate --dtype auto` asks `preferred_dtype` about this request: its chat prompt's length,
    `--max-new-tokens` (the prefill and the steps weigh differently per dtype), its temperature and the acceptance
    its policy predicts for it (none here: the prior), and decodes in what it answers."""
    from hf_blockpilot import device_calibration
    from hf_blockpilot.costs import PRIOR_ACCEPTANCE
    from hf_blockpilot.data import chat_inputs
    from hf_blockpilot.tools.loading import resolve_target

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    asked = []

    def preferred(target, drafter, batch_size=1, prompt_tokens=64, new_tokens=256, temperature=0.0, acceptance=0.5):
        asked.append((batch_size, prompt_tokens, new_tokens, temperature, acceptance))
        return torch.bfloat16

    monkeypatch.setattr(device_calibration, "preferred_dtype", preferred)
    prompt = "Write a function that reverses a list."
    args = ["generate", prompt, "--target", str(target_dir), "--drafter", str(drafter_dir), "--dtype", "auto"]
    assert main([*args, "--max-new-tokens", "5", "--temperature", "0.7", "--no-stream", "--json"]) == 0
    _, tokenizer = resolve_target(str(target_dir))
    assert asked == [(1, chat_inputs(tokenizer, prompt, "cpu").shape[1], 5, 0.7, PRIOR_ACCEPTANCE)]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "bfloat16"


COMMAND_ARGS = {  # each command with its required arguments
    "generate": ["hi"],
    "train-drafter": ["--output-dir", "{tmp}/run"],
    "prepare-hidden-states": ["--output-dir", "{tmp}/run", "--target-layer-ids", "1"],
    "eval-drafter": [],
    "collect": ["--output-dir", "{tmp}/labels"],
    "train-policy": ["--labels", "{tmp}/labels", "--output", "{tmp}/policy"],
    "calibrate": [],
    "measure-cost": ["--output", "{tmp}/cost.json"],
    "evaluate-policy": ["--policy", "{tmp}/policy"],
    "import-policy": ["{tmp}/model.pt", "--output", "{tmp}/policy"],
    "bench": [],
    "demo": [],
}


def test_every_command_is_covered_by_the_exit_status_tests():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(sub.choices) == set(COMMAND_ARGS) | {"env"}


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_bad_input_exits_2_and_runtime_failures_exit_1_with_one_line(command, tmp_path, capsys, monkeypatch):
    args = [a.format(tmp=tmp_path) for a in COMMAND_ARGS[command]]
    assert main([command, *args, "--target", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"hf-blockpilot {command}: error: ") and str(tmp_path) in err[0] and len(err) == 2

    def broken(_args):
        raise RuntimeError("the device went away\nmid-run")

    parser = build_parser()
    monkeypatch.setattr("hf_blockpilot.cli.build_parser", lambda: parser)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    sub.choices[command].set_defaults(func=broken)
    assert main([command, *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"hf-blockpilot {command}: failed: the device went away mid-run" and len(err) == 2
