"""`elastic-gpt prepare-data`: raw text in any fsspec storage -> fixed-length token shards.

The job is a Ray Data pipeline over *parts*: the sorted input files cut into consecutive groups of
about `part_bytes` of raw input. Each part becomes exactly one shard (tokens of its documents, an
end-of-text after each document, packed into records of seq_len + 1 tokens, the last record padded
with end-of-text). A shard is therefore a pure function of its part's files and the options:

- output is byte-identical for the same input, whatever the number of workers or their timing;
- parts are independent, so tokenization is embarrassingly parallel (`map_batches` on an actor
  pool, one tokenizer per actor);
- each shard is committed by a small `.done.json` marker written after it, so a re-run after an
  interruption redoes only the parts without a valid marker. `manifest.json` is written last.

Records overlap by one token (record i holds stream tokens [i*L, i*L + L + 1)): the target of the
last position of a record is the first input of the next, so no token pair of the text is lost.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import hashlib
import io
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import fsspec
import numpy as np

from elastic_gpt.data.fingerprint import sample_hashes
from elastic_gpt.data.manifest import (
    MANIFEST_NAME,
    TOKEN_BYTES_NAME,
    VALIDATION_DIR,
    Manifest,
    ShardInfo,
    describe_storage_error,
    join_url,
)
from elastic_gpt.data.token_bytes import token_byte_lengths
from elastic_gpt.data.tokenizers import get_tokenizer, save_tokenizer, token_dtype

log = logging.getLogger(__name__)

TEXT_CHUNK_BYTES = 4 << 20        # raw bytes read at a time from a plain-text file
MAX_PIECE_CHARS = 1 << 20         # longest string handed to the tokenizer at once
BAD_UTF8_POLICIES = ("replace", "skip", "error")
JSONL_EXTS = (".jsonl", ".ndjson")
COMPRESSION_EXTS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_GLOB_CHARS = "*?["
BINARY_SNIFF_BYTES = 8 << 10      # how much of a file's start the binary heuristic looks at
BINARY_BAD_UTF8_RATIO = 0.25      # latin-1 prose has a few percent; images and archives ~40%


# ----------------------------------------------------------------------------- input listing

@dataclass(frozen=True)
class InputFile:
    url: str
    size: int
    version: str  # ETag or mtime: a changed file invalidates its part's commit marker


def _has_glob(s: str) -> bool:
    return any(c in s for c in _GLOB_CHARS)


def list_inputs(inputs: str | list[str], storage_options: dict | None = None,
                max_files: int | None = None, max_bytes: int | None = None) -> list[InputFile]:
    """Every file the input URLs/globs/directories name, sorted, after the size limits."""
    specs = [inputs] if isinstance(inputs, str) else list(inputs)
    found: dict[str, InputFile] = {}
    for spec in specs:
        try:
            fs, path = fsspec.core.url_to_fs(spec, **(storage_options or {}))
            if _has_glob(path):
                entries = fs.glob(path, detail=True)
            elif fs.isdir(path):
                entries = {p: i for p, i in fs.find(path, detail=True).items()
                           if not os.path.basename(p).startswith(".")}
            elif fs.exists(path):
                entries = {path: fs.info(path)}
            else:
                raise ValueError(f"input {spec} does not exist; check the path or bucket name")
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(describe_storage_error(spec, e)) from None
        for p, info in entries.items():
            if info.get("type", "file") != "file":
                continue
            version = str(info.get("ETag") or info.get("etag") or info.get("mtime")
                          or info.get("LastModified") or info.get("updated") or "")
            url = fs.unstrip_protocol(p) if "://" in spec else p
            found[url] = InputFile(url, int(info.get("size") or 0), version)
    if not found:
        raise ValueError(f"input {specs if len(specs) > 1 else specs[0]} matched no files; "
                         "check the glob/path (quote globs so the shell does not expand them)")
    files = [found[u] for u in sorted(found)]
    if max_files is not None:
        files = files[:max_files]
    if max_bytes is not None:
        kept, total = [], 0
        for f in files:
            if kept and total + f.size > max_bytes:
                break
            kept.append(f)
            total += f.size
        files = kept
    return files


def plan_parts(files: list[InputFile], part_bytes: int | None = None) -> list[list[InputFile]]:
    """Consecutive files grouped into parts of ~part_bytes. The default depends only on the input
    size (never on the machine) so the output stays identical everywhere: ~64 parts, each
    between 256 KB and 64 MB of raw input."""
    total = sum(f.size for f in files)
    if part_bytes is None:
        part_bytes = min(64 << 20, max(256 << 10, total // 64))
    parts, cur, cur_bytes = [], [], 0
    for f in files:
        cur.append(f)
        cur_bytes += f.size
        if cur_bytes >= part_bytes:
            parts.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        parts.append(cur)
    return parts


# ----------------------------------------------------------------------------- reading documents

def _split_ext(url: str) -> tuple[str, str | None]:
    """(format extension, compression) of a file name, e.g. 'a.jsonl.zst' -> ('.jsonl', 'zstd')."""
    name = url.rsplit("/", 1)[-1].lower()
    root, ext = os.path.splitext(name)
    compression = COMPRESSION_EXTS.get(ext)
    if compression:
        root, ext = os.path.splitext(root)
    return ext, compression


class DocStats:
    """Counters reported in the summary (every skip is counted, C6)."""

    FIELDS = ("docs", "tokens", "pad_tokens", "input_bytes", "bad_utf8_docs",
              "bad_utf8_bytes", "skipped_docs", "bad_records", "empty_docs", "split_docs",
              "longest_doc_tokens")
    MAX_FIELDS = ("longest_doc_tokens",)  # merged over parts by max, the others by sum

    def __init__(self):
        for k in self.FIELDS:
            setattr(self, k, 0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def merge(cls, totals: dict, part: dict) -> None:
        """Add one part's counters into `totals` (a marker from an older job may lack some)."""
        for k, v in part.items():
            if k in cls.MAX_FIELDS:
                totals[k] = max(totals.get(k, 0), v)
            else:
                totals[k] = totals.get(k, 0) + v


class _Utf8Decoder:
    """UTF-8 decoding with the bad-byte policy, counting what it replaces."""

    def __init__(self, policy: str, where: str, stats: DocStats):
        self.policy, self.where, self.stats = policy, where, stats
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.bad = 0

    def __call__(self, data: bytes, final: bool = False) -> str:
        text = self._dec.decode(data, final)
        if "\ufffd" in text:
            bad = text.count("\ufffd") - data.count("\ufffd".encode())
            if bad > 0:
                if self.policy == "error":
                    raise ValueError(f"{self.where} is not valid UTF-8; re-encode it, or pass "
                                     "--bad-utf8 replace (or skip)")
                self.bad += bad
        return text


_FS_CACHE: dict[tuple[str, str], object] = {}


def _open_raw(url: str, storage_options: dict | None, compression: str | None):
    """Open for reading through one cached filesystem per protocol (fsspec.open re-parses its
    options on every call: measurable with thousands of small files)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    key = (protocol, json.dumps(storage_options or {}, sort_keys=True, default=str))
    if key not in _FS_CACHE:
        _FS_CACHE[key] = fsspec.core.url_to_fs(url, **(storage_options or {}))[0]
    fs = _FS_CACHE[key]
    return fs.open(fs._strip_protocol(url), "rb", compression=compression)


def looks_binary(head: bytes) -> str | None:
    """Why the first bytes of a file look like binary data rather than text (None: text).
    NUL bytes never occur in UTF-8 text; a high share of bytes that are not UTF-8 means an
    image, an archive or another encoding, not text with a few stray bytes."""
    if not head:
        return None
    if b"\x00" in head:
        return "it contains NUL bytes"
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    bad = text.count("\ufffd") - head.count("\ufffd".encode())
    if bad / len(head) > BINARY_BAD_UTF8_RATIO:
        return f"{bad / len(head):.0%} of its first {len(head):,} bytes are not UTF-8"
    return None


def _refuse_binary(f: InputFile, head: bytes) -> None:
    reason = looks_binary(head)
    if reason:
        raise ValueError(f"input {f.url} looks binary ({reason}); remove it from --input (e.g. "
                         "with a narrower glob), or pass --allow-binary to tokenize it as text")


def iter_documents(f: InputFile, storage_options: dict | None, text_field: str,
                   bad_utf8: str, stats: DocStats, content_hash, allow_binary: bool = True):
    """Yield each document of one file as a list of string pieces (long ones cut in pieces).
    `.jsonl`: one document per line's `text_field`; `.parquet`: one per row of that column;
    anything else (.txt, .py, ...): the whole file is one document. Unless `allow_binary`, a
    text or JSONL file whose first bytes look binary (`looks_binary`) is refused (C6)."""
    ext, compression = _split_ext(f.url)
    if ext == ".parquet":
        yield from _parquet_docs(f, storage_options, compression, text_field, bad_utf8,
                                 stats, content_hash)
        return
    sniffed = allow_binary
    with _open_raw(f.url, storage_options, compression) as fh:
        if ext in JSONL_EXTS:
            head = b""
            for lineno, line in enumerate(fh, 1):
                if not sniffed:
                    head += line[:BINARY_SNIFF_BYTES - len(head)]
                    if len(head) >= BINARY_SNIFF_BYTES:
                        _refuse_binary(f, head)
                        sniffed = True
                content_hash.update(line)
                stats.input_bytes += len(line)
                dec = _Utf8Decoder(bad_utf8, f"{f.url} line {lineno}", stats)
                text = dec(line, final=True)
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                    doc = rec[text_field]
                    if not isinstance(doc, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    stats.bad_records += 1
                    continue
                yield from _emit(doc, dec.bad, stats, bad_utf8)
            if not sniffed:  # a file shorter than the sniffed length
                _refuse_binary(f, head)
        else:
            dec = _Utf8Decoder(bad_utf8, f.url, stats)
            pieces = []
            while True:
                chunk = fh.read(TEXT_CHUNK_BYTES)
                if not sniffed:
                    _refuse_binary(f, chunk[:BINARY_SNIFF_BYTES])
                    sniffed = True
                content_hash.update(chunk)
                stats.input_bytes += len(chunk)
                pieces.append(dec(chunk, final=not chunk))
                if not chunk:
                    break
            yield from _emit_pieces([p for p in pieces if p], dec.bad, stats, bad_utf8)


def _parquet_docs(f, storage_options, compression, text_field, bad_utf8, stats, content_hash):
    import pyarrow.parquet as pq

    with _open_raw(f.url, storage_options, compression) as fh:
        raw = fh.read()
    content_hash.update(raw)
    stats.input_bytes += len(raw)
    pf = pq.ParquetFile(io.BytesIO(raw))
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{f.url} has no column {text_field!r} (columns: "
                         f"{pf.schema_arrow.names}); pass --text-field NAME")
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        col = batch.column(0)
        if col.type not in ("string", "large_string"):
            import pyarrow as pa

            if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
                for v in col.to_pylist():
                    if v is None:
                        stats.bad_records += 1
                        continue
                    dec = _Utf8Decoder(bad_utf8, f"{f.url} column {text_field}", stats)
                    yield from _emit(dec(v, final=True), dec.bad, stats, bad_utf8)
                continue
            raise ValueError(f"{f.url} column {text_field!r} has type {col.type}, not text; "
                             "pass --text-field NAME of a string column")
        for v in col.to_pylist():
            if v is None:
                stats.bad_records += 1
                continue
            yield from _emit(v, 0, stats, bad_utf8)


def _emit(doc: str, bad: int, stats: DocStats, bad_utf8: str):
    yield from _emit_pieces([doc] if doc else [], bad, stats, bad_utf8)


def _emit_pieces(pieces: list[str], bad: int, stats: DocStats, bad_utf8: str):
    if bad:
        if bad_utf8 == "skip":
            stats.skipped_docs += 1
            return
        stats.bad_utf8_docs += 1
        stats.bad_utf8_bytes += bad
    if not pieces:
        stats.empty_docs += 1
        return
    out = []
    for p in pieces:  # one enormous line/file is tokenized in bounded pieces; decode stays exact
        while len(p) > MAX_PIECE_CHARS:
            cut = p.rfind("\n", MAX_PIECE_CHARS // 2, MAX_PIECE_CHARS)
            cut = cut + 1 if cut > 0 else MAX_PIECE_CHARS
            out.append(p[:cut])
            p = p[cut:]
        if p:
            out.append(p)
    if len(out) > 1:
        stats.split_docs += 1
    yield out


# ----------------------------------------------------------------------------- packing shards

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


def validation_url(output: str) -> str:
    """Where the held-out split of the dataset at `output` lives (a dataset of its own)."""
    return join_url(output, VALIDATION_DIR)


def document_hash(encoded_pieces: list[bytes], seed: int) -> int:
    """A document's seeded 64-bit content hash: what decides its side of the split."""
    h = hashlib.blake2b(str(int(seed)).encode(), digest_size=8, person=b"elastic-gpt-val")
    for e in encoded_pieces:
        h.update(e)
    return int.from_bytes(h.digest(), "little")


def in_validation_split(doc_hash: int, threshold: int) -> bool:
    """A document is held out when its seeded content hash is below the threshold
    (--val-fraction F: F * 2**64; --val-docs N: just above the N-th smallest hash): a pure
    function of the text and the seed, whatever the part, the engine or the number of
    workers; identical documents land on the same side."""
    return doc_hash < threshold


def validation_threshold_for_docs(files: list[InputFile], n: int, seed: int, options: dict,
                                  storage_options: dict | None) -> int:
    """The threshold that holds out the n documents of smallest hash: one reading pass over
    the input (no tokenizing), in this process."""
    hashes = []
    for f in files:
        for pieces in iter_documents(f, storage_options, options["text_field"],
                                     options["bad_utf8"], DocStats(), hashlib.sha256(),
                                     options.get("allow_binary", True)):
            hashes.append(document_hash([p.encode("utf-8") for p in pieces], seed))
    if len(hashes) <= n:
        raise ValueError(f"--val-docs {n} would hold out all {len(hashes)} documents of the "
                         "input, leaving none to train on; lower --val-docs")
    return sorted(hashes)[n - 1] + 1


@functools.lru_cache(maxsize=4)
def _token_bytes_for(tokenizer: str) -> np.ndarray:
    return token_byte_lengths(get_tokenizer(tokenizer))


class _SplitWriter:
    """One output dataset's shard of a part: its file, its packer and its counters."""

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


def build_part(index: int, files: list[InputFile], output: str, options: dict,
               storage_options: dict | None) -> dict:
    """Tokenize one part into its shard (+ index, + commit marker), and into its validation
    shard under `output/val` when a split is asked for. Returns the marker."""
    tok = get_tokenizer(options["tokenizer"])
    encode = getattr(tok, "encode_array", tok.encode)
    token_bytes = _token_bytes_for(options["tokenizer"])
    val_threshold = options.get("val_threshold", 0)
    content_hash = hashlib.sha256()
    name = shard_name(index)
    so = storage_options or {}
    train = _SplitWriter(output, name, options, tok, token_bytes, so)
    val = _SplitWriter(validation_url(output), name, options, tok, token_bytes, so) \
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
    with fsspec.open(join_url(output, name + ".done.json"), "w", **so) as out:
        out.write(json.dumps(marker, sort_keys=True))  # written last: the shard's commit
    return marker


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
        fs, path = fsspec.core.url_to_fs(join_url(output, name + ".done.json"),
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


def tokenize_parts(batch: dict, output: str, options: dict,
                   storage_options: dict | None) -> dict:
    """Ray Data `map_batches` function: build the parts of a batch (one part per batch).
    A plain function, not an actor class: tasks run in Ray's pre-started worker processes, and
    the tokenizer is still built once per process (get_tokenizer is cached)."""
    results = []
    for index, files_json in zip(batch["index"], batch["files"]):
        files = [InputFile(**f) for f in json.loads(files_json)]
        results.append(json.dumps(_build_part_or_error(
            int(index), files, output, options, storage_options)))
    return {"result": np.array(results, dtype=object)}


def _build_part_or_error(index, files, output, options, storage_options) -> dict:
    try:
        return {**build_part(index, files, output, options, storage_options), "index": index}
    except ValueError as e:
        return {"error": str(e)}
    except Exception as e:  # storage failures, decompression errors: name the part's files
        where = files[0].url if len(files) == 1 else f"{files[0].url} (+{len(files) - 1} files)"
        return {"error": describe_storage_error(where, e)}


# ----------------------------------------------------------------------------- the job

class _Progress:
    def __init__(self, total_bytes: int, enabled: bool):
        self.t0 = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data",
                            file=sys.stderr, dynamic_ncols=True)

    def start(self) -> None:
        """Rates count from here: cluster start-up is not tokenization."""
        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.reset()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, stats: dict, nbytes: int) -> None:
        self.docs += stats["docs"]
        self.tokens += stats["tokens"]
        self.bytes += nbytes
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"docs={self.docs:,} tokens={self.tokens:,} "
                                     f"{self.bytes / dt / 1e6:.1f} MB/s", refresh=False)
            self.bar.update(nbytes)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _run_parts_local(todo, output, options, storage_options, on_done, bar):
    bar.start()
    for index, files in todo:
        on_done(index, files, _build_part_or_error(index, files, output, options, storage_options))


def _run_parts_ray(todo, output, options, storage_options, on_done, num_workers, bar):
    import ray

    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            tmp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray_prepare_data")
            ray.init(address="local", num_cpus=num_workers or min(2, os.cpu_count() or 1),
                     object_store_memory=100 << 20, include_dashboard=False,
                     _temp_dir=tmp, log_to_driver=False)
        started = True
    try:
        import logging

        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # our bar replaces its chatter
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours reports docs/tokens/MB/s instead
        ctx.print_on_execution_start = False
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        local = [u for u in (output, *(f.url for _, fs_ in todo[:1] for f in fs_)) if "://" not in u
                 or u.startswith("file://")]
        if len(nodes) > 1 and local:
            raise ValueError(
                f"{local[0]} is a local path but the Ray cluster has {len(nodes)} nodes, whose "
                "workers cannot all see it; use shared storage (s3://, gs://) or --engine local")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = max(1, min(num_workers or cpus, len(todo)))
        by_index = dict(todo)
        items = [{"index": i, "files": json.dumps([f.__dict__ for f in fs_])} for i, fs_ in todo]
        bar.start()
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            tokenize_parts, batch_size=1, compute=ray.data.TaskPoolStrategy(size=n), num_cpus=1,
            fn_kwargs={"output": output, "options": options, "storage_options": storage_options})
        for row in ds.iter_rows():
            result = json.loads(row["result"])
            index = result.get("index")
            on_done(index, by_index.get(index), result)
    finally:
        if started:
            ray.shutdown()


ENGINES = ("auto", "ray", "local")
AUTO_RAY_BYTES = 32 << 20


def choose_engine(engine: str, pending_bytes: int) -> str:
    if engine != "auto":
        return engine
    ray = sys.modules.get("ray")  # a connected driver has imported it; importing costs seconds
    connected = ray is not None and ray.is_initialized()
    if connected or os.environ.get("RAY_ADDRESS") or pending_bytes >= AUTO_RAY_BYTES:
        return "ray"
    return "local"


def prepare_data(input: str | list[str], output: str, tokenizer: str = "gpt2",
                 seq_len: int = 1024, *, storage_options: dict | None = None,
                 progress: bool = True, text_field: str = "text", bad_utf8: str = "replace",
                 max_files: int | None = None, max_bytes: int | None = None,
                 part_bytes: int | None = None, engine: str = "auto",
                 num_workers: int | None = None, overwrite: bool = False,
                 val_fraction: float = 0.0, val_docs: int = 0, val_seed: int = 0,
                 val_input: str | list[str] | None = None, allow_binary: bool = False) -> dict:
    """Tokenize `input` (URL, glob, directory, or a list of them) into a dataset at `output`.

    A validation set goes to `output/val` (a dataset of its own, same tokenizer and seq_len):
    `val_fraction` holds out about that share of the documents, whole, chosen by a seeded hash
    of their text (`in_validation_split`), and the training shards do not contain them;
    `val_docs` holds out exactly that many (the smallest hashes: one more reading pass over the
    input); or `val_input` names separate validation files. Returns the summary dict (also stored in the
    manifest's `stats`); ValueError names what is wrong and how to fix it (C6)."""
    t0 = time.perf_counter()
    if seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    if bad_utf8 not in BAD_UTF8_POLICIES:
        raise ValueError(f"--bad-utf8 must be one of {BAD_UTF8_POLICIES}, got {bad_utf8!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}; e.g. "
                         "--val-fraction 0.05 holds out 5% of the documents")
    if val_docs < 0:
        raise ValueError(f"--val-docs must be at least 0, got {val_docs}")
    if sum(bool(x) for x in (val_fraction, val_docs, val_input)) > 1:
        raise ValueError("--val-fraction, --val-docs and --val-input each name a validation "
                         "set; keep one")
    if tokenizer.endswith(".json") and "://" not in tokenizer:
        tokenizer = os.path.abspath(tokenizer)  # Ray workers may run in another directory
    tok = get_tokenizer(tokenizer)
    output = output.rstrip("/")
    if "://" not in output:
        output = os.path.abspath(output)
    options = {"tokenizer": tokenizer, "seq_len": seq_len, "dtype": token_dtype(tok.vocab_size),
               "text_field": text_field, "bad_utf8": bad_utf8, "format_version": 1}
    if hasattr(tok, "to_str"):  # a tokenizer.json: its contents, not its path, decide the tokens
        options["tokenizer_sha256"] = hashlib.sha256(tok.to_str().encode()).hexdigest()
    files = list_inputs(input, storage_options, max_files, max_bytes)
    if val_docs:
        threshold = validation_threshold_for_docs(
            files, val_docs, val_seed, {**options, "allow_binary": allow_binary},
            storage_options)
    else:
        threshold = int(val_fraction * 2 ** 64)
    split = bool(val_fraction or val_docs)
    if split:  # only then: the keys (and so the reuse) of datasets without a split stay
        options.update(val_threshold=threshold, val_seed=int(val_seed))
    parts = plan_parts(files, part_bytes)
    keys = [part_key(p, options) for p in parts]
    job_key = hashlib.sha256("".join(keys).encode()).hexdigest()
    fresh = not _output_has_entries(output, storage_options)
    _check_output_writable(output, storage_options)
    _check_output(output, job_key, storage_options, overwrite)
    options["allow_binary"] = allow_binary

    markers: dict[int, dict] = {}
    for i, key in enumerate(keys):
        m = read_marker(output, i, key, storage_options)
        if m is not None:
            markers[i] = m
    todo = [(i, parts[i]) for i in range(len(parts)) if i not in markers]
    engine = choose_engine(engine, sum(f.size for _, p in todo for f in p))
    bar = _Progress(sum(f.size for i, p in todo for f in p), progress)
    errors: list[str] = []

    def on_done(index, part_files, result):
        if "error" in result:
            errors.append(result["error"])
            return
        markers[index] = result
        bar.update(result["stats"], sum(f.size for f in part_files))

    try:
        if todo:
            if engine == "local":
                _run_parts_local(todo, output, options, storage_options, on_done, bar)
            else:
                _run_parts_ray(todo, output, options, storage_options, on_done, num_workers, bar)
    finally:
        bar.close()
    if errors:
        # Committed parts stay: a re-run after fixing the input redoes only the failed ones. A
        # new output that got no committed part is removed: a refused input leaves nothing.
        if fresh and not markers:
            _remove_output(output, storage_options)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(errors[0] + more)

    source = {"input": input if isinstance(input, str) else list(input), "files": len(files),
              "bytes": sum(f.size for f in files), "job_key": job_key,
              "text_field": text_field, "bad_utf8": bad_utf8}
    if split:
        val_markers = {i: m["val"] for i, m in markers.items()}
        val_summary = _write_manifest(
            validation_url(output), tokenizer, tok, options, len(parts), val_markers,
            {**source, "split": "validation", "of": output, "val_fraction": val_fraction,
             "val_docs": val_docs, "val_seed": val_seed}, storage_options,
            empty_hint=f"--val-fraction {val_fraction} held out none of the {len(files)} "
                       "files' documents (documents are held out whole); raise "
                       "--val-fraction, or hold out an exact number with --val-docs N")
    summary = _write_manifest(
        output, tokenizer, tok, options, len(parts), markers,
        {**source, "split": "train"} if split else source, storage_options,
        empty_hint=_empty_corpus_hint(input, files, markers, options, split))
    summary.update(parts_reused=len(parts) - len(todo), parts_built=len(todo),
                   tokenize_seconds=round(bar.seconds if todo else 0.0, 3),
                   tokenized_bytes=bar.bytes, engine=engine, output=output)
    if split:
        summary["val"] = val_summary
    if val_input:
        summary["val"] = prepare_data(
            val_input, validation_url(output), tokenizer, seq_len,
            storage_options=storage_options, progress=progress, text_field=text_field,
            bad_utf8=bad_utf8, part_bytes=part_bytes, engine=engine, num_workers=num_workers,
            overwrite=overwrite, allow_binary=allow_binary)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    _warn_if_seq_len_exceeds_documents(seq_len, summary)
    return summary


def _warn_if_seq_len_exceeds_documents(seq_len: int, summary: dict) -> None:
    longest = summary.get("longest_doc_tokens", 0)
    if longest and seq_len > longest:
        log.warning("--seq-len %d is longer than the longest document (%d tokens): every sample "
                    "spans several documents%s; a --seq-len near the documents' length trains "
                    "on whole documents", seq_len, longest,
                    " and most of it is end-of-text padding"
                    if summary["tokens"] < seq_len else "")


def _empty_corpus_hint(input, files, markers, options, split: bool) -> str:
    totals = DocStats().as_dict()
    for m in markers.values():
        DocStats.merge(totals, m["stats"])
    if totals["docs"] == 0 and split and any(m["val"]["stats"]["docs"]
                                                    for m in markers.values()):
        return (f"every document of {input} fell in the validation split; lower "
                "--val-fraction or --val-docs")
    hint = ""
    if totals["bad_records"]:
        hint = (f"; {totals['bad_records']} records had no string field "
                f"{options['text_field']!r} (pass --text-field NAME)")
    elif totals["skipped_docs"]:
        hint = f"; {totals['skipped_docs']} documents were skipped as non-UTF-8"
    return (f"the corpus {input} has no text ({len(files)} files, "
            f"{sum(f.size for f in files)} bytes){hint}")


def _output_has_entries(output: str, storage_options: dict | None) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(output, **(storage_options or {}))
        return bool(fs.exists(path) and (fs.isfile(path) or fs.ls(path)))
    except Exception:
        return True  # unknown: never remove what might be someone's


def _remove_output(output: str, storage_options: dict | None) -> None:
    try:
        fs, path = fsspec.core.url_to_fs(output, **(storage_options or {}))
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:
        log.warning("could not remove the unfinished output %s (%s)", output, e)


def _check_output_writable(output: str, storage_options: dict | None) -> None:
    """The output is a directory we can create (C6): name the *output* when it is the problem,
    before any input is read (a write failing later would be blamed on the part's input)."""
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


def _check_output(output, job_key, storage_options, overwrite):
    """Never silently replace a committed dataset made from other input (C6)."""
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
    data = _token_bytes_for(tokenizer).astype("<u2").tobytes()
    with fsspec.open(join_url(output, TOKEN_BYTES_NAME), "wb", **(storage_options or {})) as fh:
        fh.write(data)
    return TOKEN_BYTES_NAME, hashlib.sha256(data).hexdigest()


def _write_manifest(output, tokenizer, tok, options, num_parts, markers, source,
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


def format_summary(s: dict) -> str:
    mb = s["input_bytes"] / 1e6
    rate = s["tokenized_bytes"] / 1e6 / s["tokenize_seconds"] if s.get("tokenize_seconds") else 0.0
    work = (f"tokenizing ({s['engine']}) {s['tokenize_seconds']:.1f} s at {rate:.1f} MB/s; "
            f"{s['parts_built']} shards built, {s['parts_reused']} reused") if s["parts_built"] \
        else "every shard was already committed, nothing to tokenize"
    lines = [
        f"prepared {s['output']}: {s['files']:,} files ({mb:.1f} MB) -> {s['docs']:,} documents, "
        f"{s['tokens']:,} tokens, {s['samples']:,} samples in {s['shards']} shards "
        f"({s['seconds']:.1f} s; {work})",
    ]
    skips = {k: s[k] for k in ("bad_utf8_docs", "bad_utf8_bytes", "skipped_docs", "bad_records",
                               "empty_docs", "split_docs") if s.get(k)}
    if skips:
        lines.append("  counted: " + ", ".join(f"{k}={v:,}" for k, v in skips.items()))
    if s.get("text_bytes"):
        lines.append(f"  {s['text_bytes'] / max(1, s['tokens']):.2f} bytes of text per token")
    val = s.get("val")
    if val:
        lines.append(f"  validation split {s['output']}/{VALIDATION_DIR}: {val['docs']:,} "
                     f"documents, {val['tokens']:,} tokens, {val['samples']:,} samples in "
                     f"{val['shards']} shards")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, nargs="+",
                        help="corpus URL(s), glob(s) or directory(ies): s3://b/raw/*.jsonl.zst, "
                             "'/usr/lib/python3.11/**/*.py', file:///data/txt")
    parser.add_argument("--output", required=True, help="dataset directory URL to write")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (offline GPT-2 BPE), bytes, or the path of a tokenizer.json")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="model context; each sample stores seq_len + 1 tokens")
    parser.add_argument("--text-field", default="text",
                        help="JSON field / parquet column holding the text (default: text)")
    parser.add_argument("--bad-utf8", choices=BAD_UTF8_POLICIES, default="replace",
                        help="invalid UTF-8 bytes: replace with U+FFFD and count (default), "
                             "skip the document and count, or stop with an error")
    parser.add_argument("--max-files", type=int, default=None, help="use the first N files only")
    parser.add_argument("--max-bytes", type=_parse_size, default=None,
                        help="stop adding files after this much raw input (e.g. 8MB)")
    parser.add_argument("--part-bytes", type=_parse_size, default=None,
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


def _parse_size(s: str) -> int:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="prepare-data", description=__doc__.splitlines()[0])
    add_cli_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
