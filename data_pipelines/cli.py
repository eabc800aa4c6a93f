"""The command line of the dataset producers.

- `prepare`'s arguments (`add_cli_arguments`) and how they run the job (`run_from_args`): the
  same for `python -m data_pipelines prepare ARGS...` and `elastic-gpt prepare-data ARGS...`.
- The error boundary every `python -m data_pipelines` command shares (`run_command`; C6 clear
  errors): an error the user can fix prints one line `<command>: error: <what>; <how to fix>` and
  exits 2 (the traceback only under -v); any other exception is a bug: its traceback, exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from data_pipelines.engines import ENGINES
from data_pipelines.sources import BAD_UTF8_POLICIES
from data_pipelines.tokenize_job import format_summary, prepare_data
from elastic_gpt.console import setup_logging
from elastic_gpt.errors import exit_for_error

PREPARE_DESCRIPTION = ("Tokenize text from any fsspec URL or glob into fixed-length token shards "
                       "plus manifest.json (a Ray Data job).")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line like every other user error (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, nargs="+",
                        help="corpus URL(s), glob(s) or directory(ies): s3://b/raw/*.jsonl.zst, "
                             "'/usr/lib/python3.11/**/*.py', file:///data/txt")
    parser.add_argument("--output", required=True, help="dataset directory URL to write")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (offline GPT-2 BPE), bytes, the path of a tokenizer.json, or "
                             "tiktoken:PATH for a tiktoken-format vocabulary (Llama 3's "
                             "tokenizer.model)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="model context; each sample stores seq_len + 1 tokens")
    parser.add_argument("--text-field", default="text",
                        help="JSON field / parquet column holding the text (default: text)")
    parser.add_argument("--bad-utf8", choices=BAD_UTF8_POLICIES, default="replace",
                        help="invalid UTF-8 bytes: replace with U+FFFD and count (default), "
                             "skip the document and count, or stop with an error")
    parser.add_argument("--max-files", type=int, default=None, help="use the first N files only")
    parser.add_argument("--max-bytes", type=parse_size, default=None,
                        help="stop adding files after this much raw input (e.g. 8MB)")
    parser.add_argument("--part-bytes", type=parse_size, default=None,
                        help="raw input per shard (default: input/64, within 256KB..64MB)")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="ray: the Ray Data job; local: in this process; auto (default): ray "
                             "when a cluster is connected or RAY_ADDRESS is set, or the input "
                             "is over 32 MB, else local (a fresh Ray instance costs more to "
                             "start than a few MB take to tokenize)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="tokenizer actors (default: the cluster's CPUs)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset at --output prepared from other input")
    parser.add_argument("--storage-options", type=json.loads, default=None,
                        help='fsspec options as JSON, e.g. \'{"client_kwargs": '
                             '{"endpoint_url": "http://127.0.0.1:9000"}}\'')
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--val-fraction", type=float, default=0.0,
                        help="hold out this share of the documents (whole, chosen by a seeded "
                             "hash of their text) as a validation set at OUTPUT/val; the "
                             "training shards do not contain them (default 0: none)")
    parser.add_argument("--val-docs", type=int, default=0,
                        help="hold out exactly N documents (those of smallest seeded hash; "
                             "reads the input once more) as the validation set at OUTPUT/val")
    parser.add_argument("--val-seed", type=int, default=0,
                        help="seed of the validation hold-out's hash (default 0)")
    parser.add_argument("--val-input", nargs="+", default=None,
                        help="separate validation files (URLs, globs, directories), tokenized "
                             "the same way into OUTPUT/val")
    parser.add_argument("--allow-binary", action="store_true",
                        help="tokenize files that look binary (NUL bytes, mostly invalid "
                             "UTF-8) instead of refusing them")


def parse_size(s: str) -> int:
    """A size argument: 512KB, 8MB, 1GB or a number of bytes."""
    units = {"": 1, "B": 1, "KB": 1 << 10, "K": 1 << 10, "MB": 1 << 20, "M": 1 << 20,
             "GB": 1 << 30, "G": 1 << 30}
    t = s.strip().upper()
    num = t.rstrip("KMGB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"bad size {s!r}; use e.g. 512KB, 8MB, 1GB") from None


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job from parsed arguments. A user error raises ValueError("<what>; <how to fix
    it>"): the CLI prints it as its one error line and exits 2."""
    inputs = args.input[0] if len(args.input) == 1 else args.input
    val_input = getattr(args, "val_input", None)
    if val_input is not None and len(val_input) == 1:
        val_input = val_input[0]
    summary = prepare_data(
        inputs, args.output, args.tokenizer, args.seq_len,
        storage_options=args.storage_options, progress=not args.no_progress,
        text_field=args.text_field, bad_utf8=args.bad_utf8, max_files=args.max_files,
        max_bytes=args.max_bytes, part_bytes=args.part_bytes, engine=args.engine,
        num_workers=args.num_workers, overwrite=args.overwrite,
        val_fraction=getattr(args, "val_fraction", 0.0), val_docs=getattr(args, "val_docs", 0),
        val_seed=getattr(args, "val_seed", 0),
        val_input=val_input, allow_binary=getattr(args, "allow_binary", False))
    print(format_summary(summary))
    return 0


def run_command(command: str, func, args: argparse.Namespace, verbose: bool = False) -> int:
    """Run `func(args)` behind the error boundary (C6 clear errors); `command` names it in the
    error line. Returns the exit code."""
    setup_logging(logging.DEBUG if verbose else logging.INFO)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        return func(args) or 0
    except KeyboardInterrupt:
        print(f"{command}: interrupted; resume by running the same command again (committed "
              "parts are kept)", file=sys.stderr)
        return 130
    except Exception as e:
        return exit_for_error(command, e, verbose, "data_pipelines")


def build_parser(prog: str = "python -m data_pipelines prepare") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description=PREPARE_DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, and the traceback of an error")
    add_cli_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`prepare` on its own: `python -m data_pipelines.cli ARGS...` is
    `python -m data_pipelines prepare ARGS...`."""
    args = build_parser().parse_args(argv)
    return run_command("data_pipelines prepare", run_from_args, args, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
