"""`python -m data_pipelines COMMAND ARGS...`: the offline dataset producers' command line.

    python -m data_pipelines prepare --input 's3://bucket/raw/*.jsonl.zst' \\
        --output s3://bucket/tok/run1 --tokenizer gpt2 --seq-len 1024
    python -m data_pipelines train-tokenizer --input 'file:///usr/lib/python3.11/*.py' \\
        --vocab-size 4096 --output data/stdlib-bpe4k.json --val-fraction 0.05

`prepare` takes the arguments of `elastic-gpt prepare-data`; on a cluster it is what runs under
`ray job submit ... -- python -m data_pipelines prepare ...`.
"""

from __future__ import annotations

import argparse
import sys

from data_pipelines import cli, tokenizer_training


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineErrorParser(prog="python -m data_pipelines",
                               description="Offline dataset producers for elastic-gpt.")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, and the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prep = sub.add_parser("prepare", help="tokenize a raw corpus into token shards (the "
                                          "arguments of elastic-gpt prepare-data)",
                          description=cli.PREPARE_DESCRIPTION)
    cli.add_cli_arguments(prep)
    prep.set_defaults(func=cli.run_from_args)
    tt = sub.add_parser("train-tokenizer", help="learn a byte-level BPE tokenizer.json on a "
                                                "corpus's training split",
                        description=tokenizer_training.__doc__.strip().splitlines()[0])
    tokenizer_training.add_cli_arguments(tt)
    tt.set_defaults(func=tokenizer_training.run_from_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_command(f"data_pipelines {args.command}", args.func, args, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
