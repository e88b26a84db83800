"""Training prompts built offline: instructions over functions of the local CPython standard library
(:func:`stdlib_training_prompts`) and general chat prompts (:func:`chat_training_prompts`), with their tables.
The held-out evaluation sets (:mod:`hf_blockpilot.data.evaluation_sets`) are never used."""

from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .evaluation_sets import PromptRecord

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


# --------------------------------------------------------------------------------------------------------------
# General chat training prompts (writing, reasoning, maths, knowledge, advice, extraction)
# --------------------------------------------------------------------------------------------------------------

_TOPICS: tuple[str, ...] = tuple(
    """
    the ocean, volcanoes, rainforests, deserts, glaciers, the moon, black holes, the solar system, comets,
    photosynthesis, the human heart, sleep, memory, vaccines, bacteria, DNA, evolution, honeybees, wolves, octopuses,
    birds' migration, coral reefs, climate change, renewable energy, solar panels, wind turbines, electric cars,
    batteries, recycling, plastic pollution, clean water, farming, coffee, tea, bread baking, chocolate, cheese,
    spices, vegetarian cooking, street food, the Roman Empire, ancient Egypt, the Renaissance, the printing press,
    the Industrial Revolution, the Silk Road, the Olympic Games, democracy, human rights, taxes, inflation,
    supply and demand, small businesses, marketing, job interviews, remote work, teamwork, leadership,
    public speaking, negotiation, time management, procrastination, habits, motivation, stress, meditation,
    friendship, parenting, learning a language, reading, libraries, museums, poetry, jazz, classical music,
    painting, photography, film making, video games, chess, football, running, swimming, cycling, yoga,
    mountain hiking, camping, travel on a budget, trains, airports, city planning, bridges, skyscrapers,
    the internet, smartphones, social media, privacy, passwords, cybersecurity, artificial intelligence, robots,
    3D printing, space exploration, Mars, satellites, weather forecasting, earthquakes, rivers, forests,
    gardening, houseplants, dogs, cats, horses, elephants, dinosaurs, fossils, the periodic table, magnets,
    electricity, light, sound, gravity, friction, thermometers, clocks, calendars, maps, money, banks, savings,
    insurance, elections, newspapers, libraries of the future, online courses, exams, homework, teachers,
    scientists, inventors, hospitals, nutrition, exercise, running a marathon, volunteering, kindness, honesty,
    """.replace("\n", " ").split(",")
)
_TOPICS = tuple(t.strip() for t in _TOPICS if t.strip())

_PEOPLE: tuple[str, ...] = (
    "a pirate captain",
    "a medieval knight",
    "a travel guide in Rome",
    "a friendly robot",
    "a detective",
    "a chef in a busy restaurant",
    "an astronaut on the space station",
    "a museum curator",
    "a football coach",
    "a wise old librarian",
    "a startup founder",
    "a park ranger",
    "a nervous student before an exam",
)

_CHAT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short story about {topic}.",
        "Write a poem about {topic}.",
        "Write a persuasive paragraph on why people should care about {topic}.",
        "Write a blog post introduction about {topic}.",
        "Draft a polite email to a colleague proposing a workshop on {topic}.",
        "Write a product description for a board game about {topic}.",
        "Write a haiku about {topic} and explain the imagery.",
        "Write a short speech for a school assembly about {topic}.",
    ),
    "roleplay": (
        "Pretend you are {person}. Describe your typical day.",
        "Act as {person} and give advice to a beginner about {topic}.",
        "You are {person}. Explain {topic} to a group of children.",
        "Imagine you are {person} meeting someone interested in {topic}. What do you say?",
    ),
    "knowledge": (
        "Explain {topic} in simple terms.",
        "What are three interesting facts about {topic}?",
        "Give a brief history of {topic}.",
        "What are the main advantages and disadvantages of {topic}?",
        "How does {topic} affect everyday life?",
        "Explain {topic} to a ten-year-old.",
        "What are common misconceptions about {topic}?",
        "Compare {topic} and {other}. How are they similar and how are they different?",
        "Summarize the most important ideas about {topic} in five bullet points.",
    ),
    "advice": (
        "Give me five practical tips about {topic}.",
        "I want to learn more about {topic}. Where should I start?",
        "Make a one-week plan for someone who wants to get better at {topic}.",
        "What questions should I ask an expert on {topic}?",
        "How can a small town make the most of {topic}?",
    ),
    "reasoning": (
        "If {topic} disappeared tomorrow, what would change? Think step by step.",
        "Argue for and against this claim: '{topic} matters more than {other}.'",
        "What would a world without {topic} look like in fifty years?",
        "A friend says {topic} is overrated. How would you respond, with reasons?",
    ),
}

_MATH_TEMPLATES: tuple[str, ...] = (
    "A shop sells notebooks for ${a} each. Maria buys {b} notebooks and pays with ${c}. How much change does she "
    "get? Explain your steps.",
    "A train travels at {a} km per hour for {b} hours. How far does it go?",
    "There are {a} students in a class and {b} of them wear glasses. What fraction wear glasses?",
    "Tom reads {a} pages a day. How many days does he need for a book of {c} pages?",
    "A recipe needs {b} eggs for {a} cookies. How many eggs are needed for {c} cookies?",
    "What is {a} times {b}, plus {c}? Show the working.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "A jacket costs ${c} and is on sale for {b}0% off. What is the sale price?",
)


def _module_docstrings() -> list[tuple[str, str]]:
    """``(module, docstring)`` pairs of the stdlib's prose module docstrings (at least two sentences long)."""
    found = []
    for module, path in _stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if doc and 200 <= len(doc) <= 1500 and doc.count(". ") >= 2 and ">>>" not in doc:
            found.append((module, doc))
    return found


_EXTRACTION_LEADS: tuple[str, ...] = (
    "Summarize the following text in two sentences.",
    "List the key terms in this text and define each briefly.",
    "Write three quiz questions, with answers, based on this text.",
    "Rewrite this text for a beginner, in plain language.",
    "Extract the main facts from this text as a bulleted list.",
)


def chat_training_prompts(n: int, seed: int = 0) -> list[PromptRecord]:
    """Build ``n`` general chat prompts: writing, role-play, knowledge, advice, reasoning, arithmetic word
    problems, and extraction/summary tasks over prose module docstrings of the local standard library.

    Complements :func:`stdlib_training_prompts` (code-centred) so a drafter also sees the target answering
    everyday requests; topics and templates are this package's own, none of the held-out evaluation sets is
    used. Deterministic for a given ``seed``; a larger ``n`` extends a smaller one (same first records).
    Ids look like ``"chat/00042/knowledge"``; ``dataset`` is ``"chat"``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    docs = _module_docstrings() if n else []
    kinds = [*_CHAT_TEMPLATES, "math", "extraction"]
    weights = [len(t) for t in _CHAT_TEMPLATES.values()] + [4, 4 if docs else 0]
    records: list[PromptRecord] = []
    seen: set[str] = set()
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"only {len(records)} distinct chat prompts could be built, {n} asked")
        kind = rng.choices(kinds, weights)[0]
        if kind == "math":
            a, b = rng.randint(2, 40), rng.randint(2, 9)
            prompt = rng.choice(_MATH_TEMPLATES).format(a=a, b=b, c=rng.randint(a * b, a * b * 3))
        elif kind == "extraction":
            _, doc = rng.choice(docs)
            prompt = f"{rng.choice(_EXTRACTION_LEADS)}\n\n{doc}"
        else:
            topic, other = rng.sample(_TOPICS, 2)
            person = rng.choice(_PEOPLE)
            prompt = rng.choice(_CHAT_TEMPLATES[kind]).format(topic=topic, other=other, person=person)
            prompt = prompt[0].upper() + prompt[1:]
        if prompt in seen:
            continue
        seen.add(prompt)
        records.append(PromptRecord(id=f"chat/{len(records):05d}/{kind}", dataset="chat", prompt=prompt))
    return records


# --------------------------------------------------------------------------------------------------------------
# Short answers and follow-up turns (policy labels: requests as varied as real use)
# --------------------------------------------------------------------------------------------------------------

_WORDS: tuple[str, ...] = (
    "happy", "fast", "ancient", "bright", "generous", "quiet", "difficult", "warm", "honest", "narrow", "strong",
    "empty", "careful", "simple", "early", "rich", "heavy", "loud", "polite", "brave",
)  # fmt: skip
_COUNTRIES: tuple[str, ...] = (
    "France", "Japan", "Brazil", "Canada", "Egypt", "Kenya", "Australia", "Norway", "India", "Mexico", "Spain",
    "Italy", "Germany", "Chile", "Vietnam", "Peru", "Greece", "Poland", "Morocco", "Thailand",
)  # fmt: skip
_LANGUAGES: tuple[str, ...] = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
_PHRASES: tuple[str, ...] = (
    "good morning", "thank you very much", "where is the train station?", "I like tea", "see you tomorrow",
    "how much does this cost?", "the weather is nice today", "happy birthday",
)  # fmt: skip
_ONE_LINERS: tuple[str, ...] = (
    "reverses a string s", "counts the vowels in a string s", "sums the even numbers in a list xs",
    "removes duplicates from a list xs while keeping order", "returns the largest value in a dict d",
    "checks whether a string s is a palindrome", "flattens a list of lists xs", "squares every number in xs",
    "sorts a list of words by length", "joins a list of strings with commas",
)  # fmt: skip

_SHORT_TEMPLATES: tuple[str, ...] = (
    "Define {topic} in one sentence.",
    "Give a one-line summary of {topic}.",
    "Name three words related to {topic}. Reply with the words only.",
    "Write a title for an article about {topic}. Reply with the title only.",
    "Yes or no: is {topic} related to {other}?",
    "What is {a} plus {b}? Reply with the number only.",
    "What is {a} times {b}? Answer with just the number.",
    "Is {c} an even number? Answer yes or no.",
    "Which is larger, {a} or {c}?",
    "What is the opposite of '{word}'?",
    "Give one synonym for '{word}'.",
    "What is the capital of {country}?",
    "Translate '{phrase}' into {language}.",
    "Write one line of Python that {task}.",
    "In one word, how would you describe {topic}?",
)

_FOLLOW_UPS: tuple[str, ...] = (
    "Can you make that shorter?",
    "Summarize your answer in one sentence.",
    "Give me a concrete example.",
    "Explain the first point in more detail.",
    "Now rewrite it for a ten-year-old.",
    "Turn your answer into a numbered list.",
    "What are the limitations of that?",
    "Thanks. What should I do first?",
    "Can you say that more formally?",
    "Write it again, but as a short poem.",
)


def short_answer_prompts(n: int, seed: int = 0) -> list[PromptRecord]:
    """Build ``n`` requests whose answers are a word, a number or a line: definitions, arithmetic, yes/no,
    translations, capitals, one-line Python. Deterministic for a given ``seed``; ids look like
    ``"short/00042"``; ``dataset`` is ``"short"``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for _ in range(50 * n + 1000):
        if len(records) >= n:
            break
        topic, other = rng.sample(_TOPICS, 2)
        a, b = rng.randint(2, 99), rng.randint(2, 12)
        prompt = rng.choice(_SHORT_TEMPLATES).format(
            topic=topic,
            other=other,
            a=a,
            b=b,
            c=rng.randint(a + 1, 999),
            word=rng.choice(_WORDS),
            country=rng.choice(_COUNTRIES),
            phrase=rng.choice(_PHRASES),
            language=rng.choice(_LANGUAGES),
            task=rng.choice(_ONE_LINERS),
        )
        if prompt not in seen:
            seen.add(prompt)
            records.append(PromptRecord(id=f"short/{len(records):05d}", dataset="short", prompt=prompt))
    if len(records) < n:
        raise ValueError(f"only {len(records)} distinct short-answer prompts could be built, {n} asked")
    return records


def follow_up_prompts(exchanges: Sequence[tuple[PromptRecord, str]], seed: int = 0) -> list[PromptRecord]:
    """A second user turn for each ``(first prompt, the target's answer)`` exchange: "make that shorter", "give an
    example", ... Deterministic for a given ``seed``; ids are ``"multiturn/<first id>"``; ``dataset`` is
    ``"multiturn"``."""
    rng = random.Random(seed)
    return [
        PromptRecord(
            id=f"multiturn/{record.id}",
            dataset="multiturn",
            prompt=rng.choice(_FOLLOW_UPS),
            history=(*record.history, (record.prompt, answer)),
        )
        for record, answer in exchanges
    ]
