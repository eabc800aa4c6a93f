"""The default job's corpus: the standard library's top-level modules (`make data`).

    python -m data_pipelines.recipes.stdlib [--output data/stdlib-bpe4k] \\
        [--tokenizer-output data/stdlib-bpe4k.json] [--stdlib DIR]

Two steps, with the settings jobs/configs/mini.yaml trains on:

1. a 4,096-id byte-level BPE tokenizer learnt on the `*.py` files of the stdlib folder, without
   the documents step 2 holds out, written to --tokenizer-output (skipped when that file exists,
   as make skips a target that exists);
2. those files tokenized into --output with seq_len 256, 5% of the documents (chosen by a seeded
   hash of their text) held out as OUTPUT/val. A re-run reuses every committed shard.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig

import fsspec

from data_pipelines.cli import OneLineErrorParser, run_command
from data_pipelines.tokenize_job import format_summary, prepare_data
from data_pipelines.tokenizer_training import train_tokenizer

OUTPUT = "data/stdlib-bpe4k"
TOKENIZER_OUTPUT = "data/stdlib-bpe4k.json"
VOCAB_SIZE = 4096
SEQ_LEN = 256
VAL_FRACTION = 0.05


def stdlib_dir() -> str:
    """This Python's standard library folder (a venv's Python names its base installation's)."""
    return sysconfig.get_paths()["stdlib"]


def prepare_stdlib(output: str = OUTPUT, tokenizer_output: str = TOKENIZER_OUTPUT, *,
                   stdlib: str | None = None, progress: bool = True) -> dict:
    """Make the tokenizer (unless it exists) and the dataset; print what each step did and return
    the dataset's summary (`prepare_data`'s)."""
    corpus = f"file://{stdlib or stdlib_dir()}/*.py"
    fs, path = fsspec.core.url_to_fs(tokenizer_output)
    if not fs.exists(path):
        s = train_tokenizer(corpus, tokenizer_output, VOCAB_SIZE, val_fraction=VAL_FRACTION)
        print(f"trained {s['output']}: {s['vocab_size']:,} ids from {s['docs']:,} documents "
              f"({s['bytes'] / 1e6:.1f} MB)")
    tokenizer = tokenizer_output if "://" in tokenizer_output else os.path.abspath(tokenizer_output)
    summary = prepare_data(corpus, output, tokenizer, SEQ_LEN, val_fraction=VAL_FRACTION,
                           progress=progress)
    print(format_summary(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(prog="python -m data_pipelines.recipes.stdlib",
                           description=__doc__.strip().splitlines()[0])
    p.add_argument("--output", default=OUTPUT, help=f"the dataset's directory (default {OUTPUT})")
    p.add_argument("--tokenizer-output", default=TOKENIZER_OUTPUT,
                   help=f"the tokenizer.json, learnt when missing (default {TOKENIZER_OUTPUT})")
    p.add_argument("--stdlib", default=None,
                   help="the standard library folder (default: this Python's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, and the traceback of an error")
    args = p.parse_args(argv)
    return run_command("data_pipelines.recipes.stdlib", _run, args, args.verbose)


def _run(args: argparse.Namespace) -> int:
    prepare_stdlib(args.output, args.tokenizer_output, stdlib=args.stdlib,
                   progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
