"""`python -m trainloop.inspect [OVERRIDES] [--rows N]`: the first rows as the model sees them, without training.

The overrides are a run's (`data=chat data.path=F ...`); the config is checked as the run checks it.
Each row is rendered (the chat template applied) and tokenized as the run does, then printed as text
with its trained tokens (the targets of the loss) between [[ and ]], its length in tokens, how many
are trained, and what data.seq_len cuts (data.overlong): the trained tokens past it, marked `>8`
where the cut falls. Axolotl's `preprocess --debug`, for trainloop's formats that tokenize a row as
one sequence (data=chat, prompt_completion, files, pydoc, and vision_chat, whose images show as the
processor's image tokens). Exit 0, or 2 for a config it refuses.
"""

from __future__ import annotations

import argparse
import sys

from trainloop.errors import ConfigError

IGNORE = -100
OPEN, CLOSE, CUT = "[[", "]]", " >8 "


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainloop.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="a run's overrides, e.g. data=chat data.path=rows.jsonl")
    parser.add_argument("--rows", type=int, default=3, help="how many rows to show (default 3)")
    args = parser.parse_args(argv)
    try:
        shown = inspect_rows(args.overrides, args.rows)
    except ConfigError as err:
        print(f"trainloop: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(shown)


def inspect_rows(overrides: list[str], count: int) -> str:
    """The first `count` rows of the data `overrides` configure, as the model sees them (see the module)."""
    from trainloop.config.compose import compose_config
    from trainloop.data.formats import data_format
    from trainloop.data.loaders import (
        carry_chat_template, load_examples, run_tokenizer, tokenize_examples, trained_chat_template,
    )
    from trainloop.observe.metrics import library_progress_bars

    if count < 1:
        raise ConfigError(f"--rows {count}: show at least one row")
    cfg = compose_config(overrides)
    d = cfg.data
    fmt = data_format(d.name)
    if not fmt.loads_rows:
        raise ConfigError(f"data={d.name} reads tokens already prepared, not rows: inspect the rows it was prepared "
                          "from with the data= they were prepared with")
    library_progress_bars(False, loads_rows=True)
    tokenizer = run_tokenizer(cfg)  # a vision-language model's: its processor's
    carry_chat_template(tokenizer, trained_chat_template(d, tokenizer))
    rows = load_examples(d, tokenizer)
    first = rows.select(range(min(count, len(rows)))) if hasattr(rows, "select") else rows[:count]
    tokens = tokenize_examples(d, tokenizer, first, desc="inspect")
    if "input_ids" not in getattr(tokens, "column_names", tokens):
        raise ConfigError(f"data={d.name} makes items of several sequences (its pairs, or prompts to generate "
                          "from), not one sequence a row: python -m trainloop.inspect shows data=chat, "
                          "prompt_completion, files, pydoc and vision_chat rows")
    labels = tokens["labels"] if "labels" in getattr(tokens, "column_names", tokens) else None
    out = []
    for i, ids in enumerate(tokens["input_ids"]):
        row_labels = labels[i] if labels is not None else list(ids)
        out.append(shown_row(i, list(ids), list(row_labels), tokenizer, d.seq_len, d.overlong))
    return "\n\n".join(out)


def shown_row(i: int, ids: list[int], labels: list[int], tokenizer, seq_len: int, overlong: str) -> str:
    """One row: its header line (lengths, what data.seq_len cuts), then its text with the trained spans marked."""
    trained = [label != IGNORE for label in labels]
    header = f"--- row {i}: {len(ids)} tokens, {sum(trained)} trained"
    if len(ids) > seq_len:
        cut = sum(trained[seq_len:])
        if overlong == "split":
            header += f"; longer than data.seq_len={seq_len}: split into pieces of {seq_len} (data.overlong=split)"
        else:
            kept = "dropped whole" if overlong == "drop" else f"cut at {CUT.strip()}"
            header += (f"; longer than data.seq_len={seq_len}: {kept} (data.overlong={overlong}), "
                       f"{cut} of its {sum(trained)} trained tokens lost")
    pieces, start = [], 0
    while start < len(ids):  # runs of tokens trained alike, and the cut at seq_len
        end = start
        while end < len(ids) and trained[end] == trained[start] and not (end == seq_len and end > start):
            end += 1
        text = tokenizer.decode(ids[start:end])
        pieces.append(f"{OPEN}{text}{CLOSE}" if trained[start] else text)
        if end == seq_len and end < len(ids) and overlong != "split":
            pieces.append(CUT)
        start = end
    return f"{header}\n{''.join(pieces)}"


if __name__ == "__main__":
    main()
