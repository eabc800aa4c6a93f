"""Train a byte-level BPE `tokenizer.json` on a corpus, for `prepare --tokenizer PATH`.

    python -m data_pipelines train-tokenizer --input 'file:///usr/lib/python3.11/*.py' \\
        --vocab-size 4096 --output data/stdlib-bpe4k.json --val-fraction 0.05

The tokenizer is GPT-2's design (byte-level alphabet, GPT-2's pre-tokenization regex, no
normalizer), so it round-trips any text exactly, bits per byte stay exact (every token is a
fixed byte string, see elastic_gpt/data/token_bytes.py), and a Hugging Face
`PreTrainedTokenizerFast` reads the file as is. Only the merges are learnt from the corpus: a
small model spends most of its parameters and compute on a 50k-row embedding and output layer,
and GPT-2's merges, learnt on web text, cut source code into short pieces (runs of indentation,
identifiers).

The documents are read exactly as prepare-data reads them (same listing, same UTF-8 handling, one
document per text file or JSONL record: sources.py), and the documents that prepare-data holds
out with the same --val-fraction/--val-docs and --val-seed are left out (split.py), so the
validation text is unseen by the tokenizer as well as by the model: merges learnt on the held-out
files fit their identifiers and make the held-out bits per byte look better than they are.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import fsspec

from data_pipelines.sources import DocStats, iter_documents, list_inputs
from data_pipelines.split import document_hash, in_validation_split, validation_threshold_for_docs
from elastic_gpt.data.tokenizers import EOT_TEXT

DEFAULT_VOCAB = 4096


def iter_training_documents(inputs: str | list[str], *, val_fraction: float = 0.0,
                            val_docs: int = 0, val_seed: int = 0, text_field: str = "text",
                            bad_utf8: str = "replace", storage_options: dict | None = None,
                            validation: bool = False):
    """Yield each document prepare-data would put in the training split (or, with
    `validation`, in the held-out one), as one string."""
    files = list_inputs(inputs, storage_options)
    options = {"text_field": text_field, "bad_utf8": bad_utf8}
    threshold = 0
    if val_docs:
        threshold = validation_threshold_for_docs(files, val_docs, val_seed, options,
                                                  storage_options)
    elif val_fraction:
        threshold = int(val_fraction * 2.0 ** 64)
    for f in files:
        for pieces in iter_documents(f, storage_options, text_field, bad_utf8, DocStats(),
                                     hashlib.sha256()):
            held = bool(threshold) and in_validation_split(
                document_hash([p.encode("utf-8") for p in pieces], val_seed), threshold)
            if held == validation:
                yield "".join(pieces)


def train_bpe(documents, vocab_size: int = DEFAULT_VOCAB):
    """A `tokenizers.Tokenizer`: byte-level BPE with `vocab_size` ids, end-of-text among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size {vocab_size} is too small: the 256 byte tokens and "
                         "end-of-text need 257 ids; e.g. --vocab-size 4096")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
        # every byte is a token whether or not the corpus has it, so no text is ever unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return tok


def train_tokenizer(inputs: str | list[str], output: str, vocab_size: int = DEFAULT_VOCAB,
                    **split) -> dict:
    """Train on the training split of `inputs` and write `output` (a tokenizer.json path or
    fsspec URL). Returns a summary."""
    count = {"docs": 0, "bytes": 0}

    def docs():
        for d in iter_training_documents(inputs, **split):
            count["docs"] += 1
            count["bytes"] += len(d.encode("utf-8"))
            yield d

    tok = train_bpe(docs(), vocab_size)
    if count["docs"] == 0:
        raise ValueError(f"{inputs} has no training documents to learn a tokenizer from")
    if "://" not in output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with fsspec.open(output, "w", encoding="utf-8") as f:
        f.write(tok.to_str())
    return {**count, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "output": output}


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, nargs="+",
                   help="corpus URL(s), glob(s) or directory(ies), as prepare-data takes them")
    p.add_argument("--output", required=True, help="where to write the tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help=f"ids in the vocabulary, end-of-text included (default {DEFAULT_VOCAB})")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="leave out the documents prepare-data holds out with this --val-fraction")
    p.add_argument("--val-docs", type=int, default=0,
                   help="leave out the documents prepare-data holds out with this --val-docs")
    p.add_argument("--val-seed", type=int, default=0, help="prepare-data's --val-seed")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text")


def run_from_args(args: argparse.Namespace) -> int:
    """Train from parsed arguments and print one line; a user error raises ValueError."""
    s = train_tokenizer(args.input if len(args.input) > 1 else args.input[0], args.output,
                        args.vocab_size, val_fraction=args.val_fraction,
                        val_docs=args.val_docs, val_seed=args.val_seed,
                        text_field=args.text_field)
    print(f"trained {s['output']}: {s['vocab_size']:,} ids from {s['docs']:,} documents "
          f"({s['bytes'] / 1e6:.1f} MB)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_pipelines train-tokenizer",
                                description=__doc__.strip().splitlines()[0])
    add_cli_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except ValueError as e:
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
