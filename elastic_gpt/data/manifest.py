"""The dataset manifest: what `prepare-data` wrote and what the reader trusts.

Layout of a dataset directory (any fsspec URL):

    manifest.json          written last: a dataset without it is unfinished
    shard-00000.bin        num_samples fixed-size records of (seq_len + 1) little-endian tokens
    shard-00000.idx        one little-endian uint64 per record: sample_hash(record), the checksum
                           (elastic_gpt/data/fingerprint.py)
    shard-00000.done.json  per-shard commit marker, lets an interrupted job redo only missing shards

Record i of a shard starts at byte i * (seq_len + 1) * itemsize, so any sample is one ranged read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import fsspec
import numpy as np

FORMAT = "elastic-gpt-tokens"
VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    path: str              # file name relative to the dataset directory
    num_samples: int
    num_bytes: int         # num_samples * (seq_len + 1) * itemsize: checked when a reader opens it
    sha256: str            # of the whole .bin (the job's determinism/verification check)
    index_path: str        # sidecar with one uint64 sample_hash per record
    index_sha256: str
    num_docs: int = 0
    pad_tokens: int = 0    # end-of-text tokens appended to fill the shard's last record


@dataclass(frozen=True)
class Manifest:
    url: str
    seq_len: int
    vocab_size: int
    eos_id: int
    tokenizer: str
    dtype: str
    shards: tuple[ShardInfo, ...]
    num_samples: int
    num_tokens: int
    source: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    @property
    def record_tokens(self) -> int:
        return self.seq_len + 1

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def record_bytes(self) -> int:
        return self.record_tokens * self.itemsize

    @property
    def shard_sizes(self) -> list[int]:
        return [s.num_samples for s in self.shards]

    def shard_url(self, k: int) -> str:
        return join_url(self.url, self.shards[k].path)

    def index_url(self, k: int) -> str:
        return join_url(self.url, self.shards[k].index_path)

    def check_model(self, vocab_size: int, block_size: int | None = None) -> None:
        """ValueError if the model cannot consume this dataset (C6)."""
        if self.vocab_size > vocab_size:
            raise ValueError(
                f"dataset {self.url} uses tokenizer {self.tokenizer!r} with vocab_size="
                f"{self.vocab_size}, larger than model.vocab_size={vocab_size}; set "
                f"model.vocab_size >= {self.vocab_size} or re-tokenize with a smaller tokenizer")
        if block_size is not None and self.seq_len > block_size:
            raise ValueError(
                f"dataset {self.url} has seq_len={self.seq_len}, longer than model.seq_len="
                f"{block_size}; set model.seq_len >= {self.seq_len} or re-run prepare-data "
                f"with --seq-len {block_size}")

    def to_json(self) -> str:
        d = {
            "format": FORMAT, "version": VERSION,
            "tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
            "seq_len": self.seq_len, "record_tokens": self.record_tokens, "dtype": self.dtype,
            "byte_order": "little", "record_stride_tokens": self.seq_len,
            "num_samples": self.num_samples, "num_tokens": self.num_tokens,
            "shards": [s.__dict__ for s in self.shards],
            "source": self.source, "stats": self.stats,
        }
        return json.dumps(d, indent=1, sort_keys=False) + "\n"


def join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def describe_storage_error(url: str, e: BaseException) -> str:
    """One readable line for the ways object storage fails (C6)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    low = text.lower()
    if isinstance(e, PermissionError) or any(k in low for k in (
            "accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch",
            "forbidden", "403", "credentials", "expiredtoken")):
        return (f"access to {url} was denied ({text}); check the storage credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS) "
                "and the bucket policy")
    if any(k in low for k in ("nosuchbucket", "bucket does not exist")):
        return f"the bucket of {url} does not exist ({text}); check the URL"
    if isinstance(e, FileNotFoundError):
        return f"{url} does not exist; check the path"
    if isinstance(e, (ConnectionError, TimeoutError, OSError)) or any(
            k in low for k in ("connect", "endpoint", "timed out", "name resolution")):
        return (f"cannot reach the storage behind {url} ({text}); check the endpoint URL "
                "and the network")
    return f"cannot read {url} ({text})"


def load_manifest(url: str, storage_options: dict | None = None) -> Manifest:
    """Load and validate `url/manifest.json` (`url` may also name the manifest file itself)."""
    url = url.rstrip("/")
    if url.endswith("/" + MANIFEST_NAME) or url == MANIFEST_NAME:
        url = url[: -len(MANIFEST_NAME)].rstrip("/") or "."
    murl = join_url(url, MANIFEST_NAME)
    try:
        fs, path = fsspec.core.url_to_fs(murl, **(storage_options or {}))
        with fs.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(
            f"{url} is not a prepared dataset: {MANIFEST_NAME} is missing (the directory does "
            "not exist, or prepare-data did not finish); run `elastic-gpt prepare-data --input "
            f"... --output {url}`") from None
    except Exception as e:
        raise ValueError(describe_storage_error(murl, e)) from None
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{murl} is not valid JSON ({e}); re-run prepare-data") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{murl} is not an elastic-gpt dataset manifest (format="
                         f"{d.get('format') if isinstance(d, dict) else None!r}, expected "
                         f"{FORMAT!r}); re-run prepare-data")
    if d.get("version") != VERSION:
        raise ValueError(f"{murl} has manifest version {d.get('version')}, this reader "
                         f"understands {VERSION}; re-run prepare-data with this version")
    try:
        shards = tuple(ShardInfo(**s) for s in d["shards"])
        m = Manifest(
            url=url, seq_len=int(d["seq_len"]), vocab_size=int(d["vocab_size"]),
            eos_id=int(d["eos_id"]), tokenizer=str(d["tokenizer"]), dtype=str(d["dtype"]),
            shards=shards, num_samples=int(d["num_samples"]), num_tokens=int(d["num_tokens"]),
            source=d.get("source", {}), stats=d.get("stats", {}),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{murl} lacks or mangles field {e}; re-run prepare-data") from None
    if m.dtype not in ("uint16", "uint32"):
        raise ValueError(f"{murl} has dtype={m.dtype!r}; expected uint16 or uint32")
    if sum(m.shard_sizes) != m.num_samples:
        raise ValueError(f"{murl}: shard sample counts add up to {sum(m.shard_sizes)}, not "
                         f"num_samples={m.num_samples}; the manifest is corrupt")
    if m.num_samples == 0:
        raise ValueError(f"dataset {url} has no samples; re-run prepare-data on a non-empty corpus")
    return m
