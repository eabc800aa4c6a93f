"""The tokenization job's output directory: checked before any input is read, and committed by
its manifest, written last.

Before: the output must be a directory this job can write (`check_output_writable`) and must not
hold a dataset made from other input unless --overwrite (`check_output`; C6 clear errors). After
every part is committed: the token byte table, the dataset's own copy of its tokenizer, and
`manifest.json` (`write_manifest`; C4 atomic commit: a dataset without its manifest is
unfinished, and the reader trusts nothing else).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import fsspec

from data_pipelines.sources import DocStats
from data_pipelines.tokenize_part import token_bytes_for
from elastic_gpt.data.manifest import (
    MANIFEST_NAME,
    TOKEN_BYTES_NAME,
    Manifest,
    ShardInfo,
    describe_storage_error,
    join_url,
    validation_url,
)
from elastic_gpt.data.tokenizers import save_tokenizer

log = logging.getLogger(__name__)


def output_has_entries(output: str, storage_options: dict | None) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(output, **(storage_options or {}))
        return bool(fs.exists(path) and (fs.isfile(path) or fs.ls(path)))
    except Exception:
        return True  # unknown: never remove what might be someone's


def remove_output(output: str, storage_options: dict | None) -> None:
    try:
        fs, path = fsspec.core.url_to_fs(output, **(storage_options or {}))
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:
        log.warning("could not remove the unfinished output %s (%s)", output, e)


def check_output_writable(output: str, storage_options: dict | None) -> None:
    """The output is a directory we can create (C6 clear errors): name the *output* when it is
    the problem, before any input is read (a write failing later would be blamed on the part's
    input)."""
    try:
        fs, path = fsspec.core.url_to_fs(output, **(storage_options or {}))
        is_file = fs.isfile(path)
    except Exception as e:
        raise ValueError(f"--output {output}: {describe_storage_error(output, e)}") from None
    if is_file:
        raise ValueError(f"--output {output} is an existing file, not a directory; choose a "
                         "directory to write the dataset into")
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if not local:  # object stores have no directories (and makedirs could create a bucket)
        return
    try:
        fs.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"no write permission on {path}")
    except Exception as e:
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ValueError(f"cannot create or write the output directory {output} ({why}); "
                         "choose a writable --output") from None


def check_output(output, job_key, storage_options, overwrite):
    """Never silently replace a committed dataset made from other input (C6 clear errors)."""
    try:
        fs, path = fsspec.core.url_to_fs(join_url(output, MANIFEST_NAME), **(storage_options or {}))
        if not fs.exists(path):
            return
        with fs.open(path, "rb") as fh:
            old = json.loads(fh.read())
    except Exception as e:
        raise ValueError(describe_storage_error(output, e)) from None
    if old.get("source", {}).get("job_key") != job_key:
        if not overwrite:
            raise ValueError(f"{output} already holds a dataset prepared from other input or "
                             "options; choose another --output, or pass --overwrite")
        # The old dataset's validation split must not outlive it: a run would evaluate on it.
        old_val = join_url(validation_url(output), MANIFEST_NAME)
        vfs, vpath = fsspec.core.url_to_fs(old_val, **(storage_options or {}))
        if vfs.exists(vpath):
            vfs.rm(vpath)


def _write_token_bytes(output: str, tokenizer: str, storage_options) -> tuple[str, str]:
    data = token_bytes_for(tokenizer).astype("<u2").tobytes()
    with fsspec.open(join_url(output, TOKEN_BYTES_NAME), "wb", **(storage_options or {})) as fh:
        fh.write(data)
    return TOKEN_BYTES_NAME, hashlib.sha256(data).hexdigest()


def write_manifest(output, tokenizer, tok, options, num_parts, markers, source,
                    storage_options, empty_hint: str) -> dict:
    """The dataset's manifest from its parts' markers (written last: the dataset's commit)."""
    totals = DocStats().as_dict()
    content = hashlib.sha256()
    shards = []
    for i in range(num_parts):
        m = markers[i]
        DocStats.merge(totals, m["stats"])
        content.update(m.get("content_sha256", "").encode())
        if m["shard"]["num_samples"]:
            shards.append(ShardInfo(**m["shard"]))
    if totals["docs"] == 0:
        raise ValueError(empty_hint)
    num_samples = sum(s.num_samples for s in shards)
    # Bits per byte needs the byte table; it is exact only if it held for every document.
    byte_counts = all(s.text_bytes is not None for s in shards)
    token_bytes_path = token_bytes_sha = None
    if byte_counts:
        token_bytes_path, token_bytes_sha = _write_token_bytes(output, tokenizer, storage_options)
    else:
        log.warning("tokenizer %s does not map each token to fixed bytes; %s has no byte counts "
                    "(val/bits_per_byte will be unavailable)", tokenizer, output)
    text_bytes = sum(s.text_bytes for s in shards) if byte_counts else None
    # The dataset carries its tokenizer (a tokenizer.json is copied in and named relative to
    # the dataset), so it reads the same on any machine and after the original file is gone.
    recorded = save_tokenizer(tok, output)
    manifest = Manifest(
        url=output, seq_len=options["seq_len"], vocab_size=tok.vocab_size, eos_id=tok.eos_id,
        tokenizer=recorded, dtype=options["dtype"], shards=tuple(shards),
        num_samples=num_samples, num_tokens=num_samples * (options["seq_len"] + 1),
        source={**source, "fingerprint": content.hexdigest()},
        stats={**totals, "text_bytes": text_bytes},
        token_bytes_path=token_bytes_path, token_bytes_sha256=token_bytes_sha)
    with fsspec.open(join_url(output, MANIFEST_NAME), "w", **(storage_options or {})) as fh:
        fh.write(manifest.to_json())
    return {"files": source["files"], "shards": len(shards), "samples": num_samples,
            "stored_tokens": manifest.num_tokens, **totals, "text_bytes": text_bytes,
            "source_fingerprint": content.hexdigest()}
