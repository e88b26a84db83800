"""Per-slot acceptance of prompt lookup's drafts by the length of the n-gram the lookup matched, along greedy
answers: the target's own answers, so a looked-up draft is accepted iff it equals the answer's next token. Rounds
run as the loop runs them (`NgramLookup` at each round, up to 8 drafts, commit the accepted ones + 1). What
`LOOKUP_ACCEPTANCE` in hf_blockpilot/controllers.py is read from.

    .venv/bin/python scripts/lookup_acceptance.py training-data/smollm2-135m-instruct-answers-seed7.jsonl.gz
    .venv/bin/python scripts/lookup_acceptance.py runs/lookup-alone/answers.json   # the held-out answers

Prints, per matched length, each slot's acceptance (given the slots before it accepted) and its trials, per source
(the id's prefix in a training file: `stdlib`, `chat`; a held-out answers file is one source).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from collections.abc import Iterator

import torch

from hf_blockpilot.prompt_lookup import MAX_NGRAM, MIN_NGRAM, NgramLookup

SLOTS = 8


def answers(path: str) -> Iterator[tuple[str, list[int], list[int]]]:
    """(source, prompt ids, answer ids) of every answer in a training JSONL(.gz) or a lookup bench answers.json."""
    if path.endswith(".json"):
        for record in json.load(open(path)).values():
            yield "held-out", record["prompt"], record["answer"]
        return
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as lines:
        for line in lines:
            record = json.loads(line)
            yield record["id"].split("/")[0], record["prompt_ids"], record["response_ids"]


def count(prompt: list[int], answer: list[int], stats: dict) -> None:
    """Add one answer's lookup rounds to `stats[(matched length, slot)] = [accepted, trials]`."""
    tokens, lookup = prompt + answer, NgramLookup()
    ids = torch.tensor([tokens])  # the lookup reads each round's committed prefix (a view) and indexes only new ids
    end = len(prompt) + 1  # the committed tokens: the prompt and the prefill's one
    while end < len(tokens):
        looked = lookup.continuation(ids[:, :end], SLOTS)
        accepted = 0
        for slot, draft in enumerate(looked[: len(tokens) - end]):
            stats[(lookup.matched, slot)][1] += 1
            if draft != tokens[end + slot]:
                break
            stats[(lookup.matched, slot)][0] += 1
            accepted += 1
        end += accepted + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("answers", help="a training JSONL(.gz) with prompt_ids / response_ids, or an answers.json")
    args = parser.parse_args()
    per_source: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    for source, prompt, answer in answers(args.answers):
        count(prompt, answer, per_source[source])
    for source, stats in sorted(per_source.items()):
        print(source)
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            cells = [stats[(n, slot)] for slot in range(SLOTS)]
            print(f"  {n}-gram", " ".join(f"{a / t:.2f}({t})" if t else "-" for a, t in cells))


if __name__ == "__main__":
    main()
