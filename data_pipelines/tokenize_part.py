"""One part of the input -> its shard(s) and its commit marker: the unit of work of the
tokenization job, the same whichever engine runs it (engines.py).

A shard is a pure function of its part's files and the options, so the output is byte-identical
for the same input whatever the number of workers or their timing. With a validation split, each
document goes whole to the part's training shard or to its validation shard under `output/val`
(split.py), both committed by the one marker.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from data_pipelines.shards import SplitShardWriter, part_key, shard_name, write_marker
from data_pipelines.sources import InputFile, iter_documents
from data_pipelines.split import document_hash, in_validation_split
from elastic_gpt.data.manifest import describe_storage_error, validation_url
from elastic_gpt.data.token_bytes import token_byte_lengths
from elastic_gpt.data.tokenizers import get_tokenizer


@functools.lru_cache(maxsize=4)
def token_bytes_for(tokenizer: str) -> np.ndarray:
    """The tokenizer's byte table (token_bytes.py), built once per process."""
    return token_byte_lengths(get_tokenizer(tokenizer))


def build_part(index: int, files: list[InputFile], output: str, options: dict,
               storage_options: dict | None) -> dict:
    """Tokenize one part into its shard (+ index, + commit marker), and into its validation
    shard under `output/val` when a split is asked for. Returns the marker."""
    tok = get_tokenizer(options["tokenizer"])
    encode = getattr(tok, "encode_array", tok.encode)
    token_bytes = token_bytes_for(options["tokenizer"])
    val_threshold = options.get("val_threshold", 0)
    content_hash = hashlib.sha256()
    name = shard_name(index)
    so = storage_options or {}
    train = SplitShardWriter(output, name, options, tok, token_bytes, so)
    val = SplitShardWriter(validation_url(output), name, options, tok, token_bytes, so) \
        if val_threshold > 0 else None
    bytes_exact = True  # the byte table held for every document (see token_bytes.py)
    try:
        for f in files:
            for pieces in iter_documents(f, storage_options, options["text_field"],
                                         options["bad_utf8"], train.stats, content_hash,
                                         options.get("allow_binary", True)):
                encoded = [p.encode("utf-8") for p in pieces]
                ids = [encode(p) for p in pieces]
                if bytes_exact:
                    bytes_exact = all(int(token_bytes[np.asarray(i, np.int64)].sum()) == len(e)
                                      for i, e in zip(ids, encoded))
                dest = train
                if val is not None and in_validation_split(
                        document_hash(encoded, options["val_seed"]), val_threshold):
                    dest = val
                n = 0
                for i in ids:
                    dest.w.add(i)
                    n += len(i)
                dest.w.add([tok.eos_id])
                dest.stats.docs += 1
                dest.stats.tokens += n + 1
                dest.stats.longest_doc_tokens = max(dest.stats.longest_doc_tokens, n)
    except BaseException:
        train.abort()
        if val is not None:
            val.abort()
        raise
    marker = {"key": part_key(files, options), "content_sha256": content_hash.hexdigest(),
              **train.finish(options, bytes_exact), "files": len(files)}
    if val is not None:
        marker["val"] = val.finish(options, bytes_exact)
        # Input counters (bytes read, skips) stay with the part's training side; the documents
        # and tokens are counted where they went.
        for k in ("input_bytes", "bad_utf8_docs", "bad_utf8_bytes", "skipped_docs",
                  "bad_records", "empty_docs", "split_docs"):
            marker["val"]["stats"][k] = 0
    write_marker(output, index, marker, storage_options)  # written last: the shard's commit
    return marker


def build_part_or_error(index, files, output, options, storage_options) -> dict:
    """`build_part`'s marker (with its index), or {"error": line} naming what is wrong with the
    part's input or storage (C6 clear errors): the engines report it instead of raising."""
    try:
        return {**build_part(index, files, output, options, storage_options), "index": index}
    except ValueError as e:
        return {"error": str(e)}
    except Exception as e:  # storage failures, decompression errors: name the part's files
        where = files[0].url if len(files) == 1 else f"{files[0].url} (+{len(files) - 1} files)"
        return {"error": describe_storage_error(where, e)}
