"""The inputs of a dataset producer: listing them, grouping them into parts, reading documents.

- `list_inputs`: every file that URLs, globs or directories name (any fsspec storage), sorted.
- `group_into_parts`: consecutive files cut into parts of about `part_bytes` of raw input; one
  part becomes one shard (shards.py), so a part is the unit of work and of reuse.
- `iter_documents`: one file's documents as string pieces. `.jsonl`/`.ndjson`: one per line's
  text field; `.parquet`: one per row of a column; anything else: the whole file. Gzip and zstd
  are read through; bad UTF-8 follows the --bad-utf8 policy, counted in `DocStats`; a file that
  looks binary is refused unless allowed (C6 clear errors).
"""

from __future__ import annotations

import codecs
import io
import json
import os
from dataclasses import dataclass

import fsspec

from elastic_gpt.data.manifest import describe_storage_error

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


def group_into_parts(files: list[InputFile], part_bytes: int | None = None) -> list[list[InputFile]]:
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
    """Counters reported in the summary (every skip is counted, C6 clear errors)."""

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
    text or JSONL file whose first bytes look binary (`looks_binary`) is refused (C6 clear
    errors)."""
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
