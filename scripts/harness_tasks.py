"""Write the shipped lm-evaluation-harness tasks' data, examples/harness/*.jsonl (run once; the files
are committed, so what they hold does not move with the Python that runs this).

Both tasks are built from the first sentences of the standard library's docstrings, text of the
kind the default run trains on (pydoc_data's topics, which hold none of them):
- pydoc_order (multiple choice): a sentence's first half, and its second half four times: as
  written and in three other orders of its words (the same characters, so the same length, and
  the full stop last in each).
  Chance is 1/4; a model that has learnt how the documentation reads picks the order written.
- pydoc_words (generate until): a sentence up to the first letters of one of its words; the model
  writes the rest of that word (exact match).

Usage: python scripts/harness_tasks.py [--items 200]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "harness"
MODULES = (
    "os.path", "collections", "json", "re", "string", "itertools", "functools", "math", "textwrap", "shutil",
    "random", "statistics", "heapq", "bisect", "fractions", "decimal", "pathlib", "glob", "fnmatch", "difflib",
    "calendar", "copy", "operator", "tempfile", "zipfile", "csv", "base64", "hashlib", "urllib.parse", "html",
    "uuid", "time", "datetime", "codecs", "io", "struct", "array", "enum", "typing", "inspect", "ast", "tokenize",
    "pprint", "logging", "argparse", "subprocess", "threading", "queue", "socket", "gzip", "tarfile",
    "configparser", "secrets", "weakref", "contextlib", "abc", "numbers", "cmath", "locale", "gettext",
    "platform", "shlex", "sched", "selectors", "signal", "mimetypes", "sqlite3", "pickle", "zlib", "bz2",
    "lzma", "filecmp", "stat", "os",
)
SENTENCE = re.compile(r"[A-Z][A-Za-z0-9 ,;:'()\-]+\.")


def sentences() -> list[str]:
    """First sentences of public docstrings: one line, 40 to 110 characters, 7 words or more."""
    found = set()
    for name in MODULES:
        module = importlib.import_module(name)
        for key, obj in vars(module).items():
            if key.startswith("_"):
                continue
            members = [obj] + ([v for k, v in vars(obj).items() if not k.startswith("_")]
                               if inspect.isclass(obj) else [])
            for member in members:
                try:
                    doc = inspect.getdoc(member)
                except Exception:  # noqa: BLE001 - a descriptor that will not be read
                    continue
                first = (doc or "").split("\n\n")[0].replace("\n", " ").strip()
                if SENTENCE.fullmatch(first) and 40 <= len(first) <= 110 and len(first.split()) >= 7:
                    found.add(first)
    return sorted(found)


def halves(sentence: str) -> tuple[str, str]:
    words = sentence.split()
    cut = len(words) // 2
    return " ".join(words[:cut]), " ".join(words[cut:])


def order(picked: list[str], rng: random.Random) -> list[dict]:
    items = []
    for sentence in picked:
        context, ending = halves(sentence)
        words = ending[:-1].split()  # the full stop stays at the end: only the words' order tells
        if len(words) < 4:  # fewer than 4 distinct orders
            continue
        choices = [ending]
        while len(choices) < 4:
            other = " ".join(rng.sample(words, len(words))) + "."
            if other not in choices:
                choices.append(other)
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(ending)})
    return items


def words(picked: list[str], rng: random.Random) -> list[dict]:
    items = []
    for sentence in picked:
        tokens = sentence.split()
        long = [i for i, w in enumerate(tokens) if i >= 2 and re.fullmatch(r"[a-z]{6,}[.,]?", w)]
        if not long:
            continue
        i = rng.choice(long)
        word = tokens[i].rstrip(".,")
        shown = rng.choice((2, 3))
        items.append({"context": " ".join(tokens[:i] + [word[:shown]]), "target": word[shown:]})
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200, help="items per task")
    args = parser.parse_args()
    pool = sentences()
    rng = random.Random(0)
    shuffled = rng.sample(pool, len(pool))
    ordered = order(shuffled, rng)[:args.items]
    used = {item["context"] for item in ordered}
    tasks = {"pydoc_order": ordered,
             "pydoc_words": words([s for s in shuffled if halves(s)[0] not in used], rng)[:args.items]}
    for name, items in tasks.items():
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        print(f"{path}: {len(items)} items")


if __name__ == "__main__":
    main()
