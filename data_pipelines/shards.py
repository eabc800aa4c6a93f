"""Shards on storage: packing tokens into a shard, naming a part's files, and its commit marker.

Part i of the input becomes `shard-<i:05d>.bin` (records of seq_len + 1 tokens), its per-record
hash index `shard-<i:05d>.idx` and, written after both, its commit marker `shard-<i:05d>.done.json`
(C4 atomic commit: a shard without a valid marker does not exist). The marker holds the part's
key (`part_key`: its files and the options that decide its bytes), so a re-run after an
interruption or with other input redoes exactly the parts whose marker is missing or stale
(`read_marker`).

Records overlap by one token (record i holds stream tokens [i*L, i*L + L + 1)): the target of the
last position of a record is the first input of the next, so no token pair of the text is lost.
"""

from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np

from data_pipelines.sources import DocStats, InputFile
from elastic_gpt.data.fingerprint import sample_hashes
from elastic_gpt.data.manifest import VALIDATION_DIR, ShardInfo, join_url

MARKER_SUFFIX = ".done.json"


class ShardWriter:
    """Packs a token stream into overlapping records of L + 1 tokens (stride L) and writes them,
    plus the per-record hash index, as it goes (memory stays O(one flush)). With a token byte
    table it also sums the UTF-8 bytes behind the records' target tokens (positions 1..L of each
    record: what the loss is taken over, each stream token counted once)."""

    def __init__(self, fh, seq_len: int, dtype: str, eos_id: int,
                 token_bytes: np.ndarray | None = None):
        self.fh, self.L, self.dtype, self.eos_id = fh, seq_len, np.dtype(dtype), eos_id
        self.token_bytes = token_bytes
        self.buf: list[np.ndarray] = []
        self.buf_len = 0
        self.hashes: list[np.ndarray] = []
        self.sha = hashlib.sha256()
        self.num_samples = 0
        self.pad_tokens = 0
        self.text_bytes = 0

    def add(self, ids) -> None:
        self.buf.append(np.asarray(ids, dtype=np.int64))
        self.buf_len += len(ids)
        if self.buf_len >= 64 * (self.L + 1):
            self._flush()

    def _flush(self, final: bool = False) -> None:
        b = np.concatenate(self.buf) if self.buf else np.zeros(0, np.int64)
        n, L = len(b), self.L
        if final and n > 1 and (n - 1) % L:  # pad the last record with end-of-text
            pad = L - (n - 1) % L
            b = np.concatenate([b, np.full(pad, self.eos_id, np.int64)])
            self.pad_tokens += pad
            n = len(b)
        r = (n - 1) // L if n > L else 0
        if r:
            records = b[np.arange(r)[:, None] * L + np.arange(L + 1)]
            data = records.astype(self.dtype.newbyteorder("<")).tobytes()
            self.fh.write(data)
            self.sha.update(data)
            self.hashes.append(sample_hashes(records))
            self.num_samples += r
            if self.token_bytes is not None:
                self.text_bytes += int(self.token_bytes[records[:, 1:]].sum())
        rest = b[r * L:]
        self.buf, self.buf_len = [rest], len(rest)

    def finish(self) -> np.ndarray:
        self._flush(final=True)
        return np.concatenate(self.hashes) if self.hashes else np.zeros(0, "<u8")


# Options that change how a job runs but not what a committed shard holds: kept out of the part
# keys, so passing them does not redo (or refuse to reuse) shards already written.
RUN_ONLY_OPTIONS = ("allow_binary",)


def part_key(files: list[InputFile], options: dict) -> str:
    kept = {k: v for k, v in options.items() if k not in RUN_ONLY_OPTIONS}
    payload = json.dumps({"files": [(f.url, f.size, f.version) for f in files],
                          "options": kept}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_marker(output: str, index: int, marker: dict, storage_options: dict | None) -> None:
    """Commit part `index`: its marker is written after its shards (C4 atomic commit)."""
    with fsspec.open(join_url(output, shard_name(index) + MARKER_SUFFIX), "w",
                     **(storage_options or {})) as out:
        out.write(json.dumps(marker, sort_keys=True))


class SplitShardWriter:
    """One output dataset's shard of a part (the training split's, or the validation split's
    under `output/val`): its file, its packer and its counters."""

    def __init__(self, output: str, name: str, options: dict, tok, token_bytes, so: dict):
        self.output, self.name, self.so = output, name, so
        self.bin_url = join_url(output, name + ".bin")
        self.stats = DocStats()
        self.fh = fsspec.open(self.bin_url, "wb", **so).open()
        self.w = ShardWriter(self.fh, options["seq_len"], options["dtype"], tok.eos_id,
                             token_bytes)

    def finish(self, options: dict, bytes_exact: bool) -> dict:
        hashes = self.w.finish()
        self.fh.close()
        self.stats.pad_tokens = self.w.pad_tokens
        idx_bytes = hashes.astype("<u8").tobytes()
        with fsspec.open(join_url(self.output, self.name + ".idx"), "wb", **self.so) as out:
            out.write(idx_bytes)
        shard = ShardInfo(
            path=self.name + ".bin", num_samples=self.w.num_samples,
            num_bytes=self.w.num_samples * (options["seq_len"] + 1)
            * np.dtype(options["dtype"]).itemsize,
            sha256=self.w.sha.hexdigest(), index_path=self.name + ".idx",
            index_sha256=hashlib.sha256(idx_bytes).hexdigest(), num_docs=self.stats.docs,
            pad_tokens=self.w.pad_tokens, text_bytes=self.w.text_bytes if bytes_exact else None)
        return {"shard": shard.__dict__, "stats": self.stats.as_dict()}

    def abort(self) -> None:
        self.fh.close()


def _shard_complete(fs, directory: str, shard: dict) -> bool:
    if not shard["num_samples"]:
        return True
    try:
        return (fs.size(directory + "/" + shard["path"]) == shard["num_bytes"]
                and fs.size(directory + "/" + shard["index_path"]) == 8 * shard["num_samples"])
    except Exception:
        return False


def read_marker(output: str, index: int, key: str, storage_options: dict | None) -> dict | None:
    """The part's commit marker if it is valid for this key and its shards are complete."""
    name = shard_name(index)
    try:
        fs, path = fsspec.core.url_to_fs(join_url(output, name + MARKER_SUFFIX),
                                         **(storage_options or {}))
        with fs.open(path, "rb") as fh:
            marker = json.loads(fh.read())
        if marker.get("key") != key:
            return None
        if not _shard_complete(fs, fs._parent(path), marker["shard"]):
            return None
        if "val" in marker and not _shard_complete(
                fs, fs._parent(path) + "/" + VALIDATION_DIR, marker["val"]["shard"]):
            return None
        return marker
    except Exception:
        return None
