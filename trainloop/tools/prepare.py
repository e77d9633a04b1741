"""`python -m trainloop.prepare OUT_DIR [overrides]`: tokenize a corpus once into memory-mapped shards.

The overrides are a run's (data=files data.path=X, model=..., data.tokenizer=..., trainer.seed=...):
the rows are loaded, tokenized and labelled exactly as that run would, the validation documents
are held out as it would hold them out, and the result is written to OUT_DIR (see
trainloop/data/shards.py, the writer, for the layout). Train from it with `data=prepared data.path=OUT_DIR`.
An interrupted prepare is continued by running the same command again.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from trainloop.config.compose import ConfigError, compose_config


def keys_read() -> set[str]:
    """What shapes the tokens and the split: the tokenizer, the seed and the keys of the data formats
    that tokenize (trainloop.data.formats; one source at a time, so no data.sources). Every other key is
    chosen when training from the shards."""
    from trainloop.data.formats import FORMATS

    return {"model.name_or_path", "trainer.seed", "data.tokenizer",
            *(key for fmt in FORMATS.values() if fmt.loads_rows for key in fmt.reads() if key != "data.sources")}


def check_keys_read(overrides: list[str]) -> None:
    """A key prepare does not read is refused, not silently dropped (data.seq_len belongs to the run)."""
    reads = keys_read()
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if "." in key and not key.startswith("hydra.") and key not in reads:
            raise ConfigError(f"{key}: python -m trainloop.prepare does not read it (it reads "
                              f"{', '.join(sorted(reads))}); give it when training with data=prepared")


def main(argv: list[str] | None = None) -> int:
    from trainloop.data.shards import SHARD_DOCUMENTS

    parser = argparse.ArgumentParser(prog="python -m trainloop.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the folder to write the shards into (new, or one this command began)")
    parser.add_argument("--shard-documents", type=int, default=SHARD_DOCUMENTS, metavar="N",
                        help=f"rows per shard (default {SHARD_DOCUMENTS:,}); a re-run keeps the finished shards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides (data=..., model=...)")
    args = parser.parse_intermixed_args(argv)  # options may come after the overrides too
    if args.shard_documents < 1:
        parser.error("--shard-documents must be 1 or more")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from trainloop.data.shards import prepare
        from trainloop.lifetime import register_forked_children
        from trainloop.observe.metrics import library_progress_bars

        register_forked_children()  # datasets.map's pool (data.num_proc) ends with this command
        library_progress_bars(not args.no_progress, loads_rows=True)  # datasets' map and filter bars too

        check_keys_read(args.overrides)
        manifest = prepare(compose_config(args.overrides), args.out_dir, args.shard_documents,
                           progress=not args.no_progress)
    except ConfigError as err:
        print(f"trainloop: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out_dir}: {manifest['documents']} documents ({manifest['validation_documents']} held out for "
          f"validation), {manifest['tokens']} tokens as {manifest['dtype']} in {len(manifest['shards'])} shards; "
          f"train with data=prepared data.path={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
