"""The dataset manifest: what `prepare-data` wrote and what the reader trusts.

Layout of a dataset directory (any fsspec URL):

    manifest.json          written last: a dataset without it is unfinished
    shard-00000.bin        num_samples fixed-size records of (seq_len + 1) little-endian tokens
    shard-00000.idx        one little-endian uint64 per record: sample_hash(record), the checksum
                           (elastic_gpt/data/fingerprint.py)
    shard-00000.done.json  per-shard commit marker, lets an interrupted job redo only missing shards
    token_bytes.bin        (version 2) one little-endian uint16 per token id: the UTF-8 bytes of
                           text that token stands for (0 for end-of-text), so the bytes behind any
                           run of tokens, and hence bits per byte, are a table lookup
    val/                   (optional) the held-out validation split: a dataset of its own

Record i of a shard starts at byte i * (seq_len + 1) * itemsize, so any sample is one ranged read.

Version 1 manifests (no byte table) still load: `token_bytes_path` is then None and bits per byte
is unavailable for that dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import fsspec
import numpy as np

FORMAT = "elastic-gpt-tokens"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
TOKEN_BYTES_NAME = "token_bytes.bin"
VALIDATION_DIR = "val"


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
    text_bytes: int | None = None  # UTF-8 bytes behind the records' target tokens (version 2)


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
    version: int = VERSION
    token_bytes_path: str | None = None    # relative to the dataset directory; None: unknown
    token_bytes_sha256: str | None = None

    @property
    def has_byte_counts(self) -> bool:
        """Whether the bytes behind the tokens are known (bits per byte can be computed)."""
        return self.token_bytes_path is not None

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
        """ValueError if the model cannot consume this dataset (C6 clear errors)."""
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

    def load_token_bytes(self, storage_options: dict | None = None) -> np.ndarray | None:
        """The byte length of every token id (int64 array of vocab_size), checked against the
        manifest's sha256; None for a dataset written without it (version 1)."""
        if self.token_bytes_path is None:
            return None
        url = join_url(self.url, self.token_bytes_path)
        try:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
            with fs.open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise ValueError(f"{url} is missing; the dataset is incomplete, re-run "
                             "prepare-data") from None
        except Exception as e:
            raise ValueError(describe_storage_error(url, e)) from None
        if hashlib.sha256(raw).hexdigest() != self.token_bytes_sha256 or \
                len(raw) != 2 * self.vocab_size:
            raise ValueError(f"{url} does not match its manifest (size or sha256); the dataset "
                             "is corrupt, re-run prepare-data")
        return np.frombuffer(raw, dtype="<u2").astype(np.int64)

    def to_json(self) -> str:
        d = {
            "format": FORMAT, "version": VERSION,
            "tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
            "seq_len": self.seq_len, "record_tokens": self.record_tokens, "dtype": self.dtype,
            "byte_order": "little", "record_stride_tokens": self.seq_len,
            "num_samples": self.num_samples, "num_tokens": self.num_tokens,
            "shards": [s.__dict__ for s in self.shards],
            "source": self.source, "stats": self.stats,
            "token_bytes": None if self.token_bytes_path is None else {
                "path": self.token_bytes_path, "sha256": self.token_bytes_sha256,
                "dtype": "uint16"},
        }
        return json.dumps(d, indent=1, sort_keys=False) + "\n"


def join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def validation_url(output: str) -> str:
    """Where the held-out split of the dataset at `output` lives (a dataset of its own)."""
    return join_url(output, VALIDATION_DIR)


def describe_storage_error(url: str, e: BaseException) -> str:
    """One readable line for the ways object storage fails (C6 clear errors)."""
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
    if d.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{murl} has manifest version {d.get('version')}, this reader "
                         f"understands {', '.join(map(str, READABLE_VERSIONS))}; re-run "
                         "prepare-data with this version")
    try:
        shards = tuple(ShardInfo(**s) for s in d["shards"])
        token_bytes = d.get("token_bytes") or {}
        m = Manifest(
            url=url, seq_len=int(d["seq_len"]), vocab_size=int(d["vocab_size"]),
            eos_id=int(d["eos_id"]), tokenizer=str(d["tokenizer"]), dtype=str(d["dtype"]),
            shards=shards, num_samples=int(d["num_samples"]), num_tokens=int(d["num_tokens"]),
            source=d.get("source", {}), stats=d.get("stats", {}), version=int(d["version"]),
            token_bytes_path=token_bytes.get("path"),
            token_bytes_sha256=token_bytes.get("sha256"),
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{murl} lacks or mangles field {e}; re-run prepare-data") from None
    if m.dtype not in ("uint16", "uint32"):
        raise ValueError(f"{murl} has dtype={m.dtype!r}; expected uint16 or uint32")
    if sum(m.shard_sizes) != m.num_samples:
        raise ValueError(f"{murl}: shard sample counts add up to {sum(m.shard_sizes)}, not "
                         f"num_samples={m.num_samples}; the manifest is corrupt")
    if m.num_samples == 0:
        raise ValueError(f"dataset {url} has no samples; re-run prepare-data on a non-empty corpus")
    return m


def check_compatible(reference: Manifest, other: Manifest, what: str) -> None:
    """ValueError unless `other` holds the same kind of tokens as `reference` (tokenizer,
    vocabulary, end-of-text id, sequence length): a mixture's sources, or a validation set next
    to its training data (C6 clear errors). `what` names `other` in the message (e.g.
    "data.sources[1]")."""
    for key in ("tokenizer", "vocab_size", "eos_id", "seq_len"):
        want, got = getattr(reference, key), getattr(other, key)
        if want != got:
            raise ValueError(
                f"{what} ({other.url}) has {key}={got!r} but the training data "
                f"({reference.url}) has {key}={want!r}; re-run prepare-data on it with "
                f"--tokenizer {reference.tokenizer} --seq-len {reference.seq_len}")


def _exists(url: str, storage_options: dict | None) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return fs.exists(path)
    except Exception as e:
        raise ValueError(describe_storage_error(url, e)) from None


def open_validation_manifest(eval_path: str, data_path: str, training: Manifest,
                             storage_options: dict | None = None) -> Manifest | None:
    """The validation set a run evaluates on: `eval_path` when set (it must be a prepared dataset
    of the training data's tokenizer and seq_len), else the held-out split prepare-data wrote at
    `<data_path>/val` when there is one, else None (no evaluation). Raises ValueError (C6 clear
    errors) for an eval.path that is missing or does not match; the driver's preflight can call it
    as is."""
    if eval_path:
        manifest = load_manifest(eval_path, storage_options)
        what = "eval.path"
    else:
        if not data_path:
            return None
        url = join_url(data_path.rstrip("/"), VALIDATION_DIR)
        if not _exists(join_url(url, MANIFEST_NAME), storage_options):
            return None
        manifest = load_manifest(url, storage_options)
        what = "the validation split"
    check_compatible(training, manifest, what)
    return manifest
