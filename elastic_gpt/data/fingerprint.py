"""The data fingerprint: a 52-bit hash per sample and the order-independent sum of them per step.

Each record's hash is stored next to it (the shard's `.idx` sidecar, written by prepare-data and
checked by the reader); a step's fingerprint is the sum of the hashes of every sample it trained
on, mod 2**52, all-reduced over the ranks and logged as `data_fingerprint` (C5 one MLflow run).
Equal fingerprints at every step mean two runs saw the same samples, whatever their world sizes (C2
data order).

52 bits because a float64 holds every integer below 2**53: the fingerprint survives MLflow's
float metrics exactly, and so does the sum of a few 26-bit halves in a float64 all-reduce.
Nothing here knows about shards, ranks or torch.distributed.
"""

from __future__ import annotations

import hashlib

import numpy as np

FINGERPRINT_BITS = 52
FINGERPRINT_MASK = (1 << FINGERPRINT_BITS) - 1
_HALF_BITS = FINGERPRINT_BITS // 2
_HALF_MASK = (1 << _HALF_BITS) - 1


def sample_hash(sample_tokens) -> int:
    """52-bit content hash of one sample, independent of the storage dtype (tokens are hashed as
    little-endian int64)."""
    if hasattr(sample_tokens, "detach"):  # torch.Tensor, without importing torch here
        sample_tokens = sample_tokens.detach().cpu().numpy()
    data = np.ascontiguousarray(sample_tokens, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & FINGERPRINT_MASK


def sample_hashes(records: np.ndarray) -> np.ndarray:
    """sample_hash of every row of a (n, record_tokens) array, as uint64."""
    wide = np.ascontiguousarray(records, dtype="<i8")
    out = np.empty(len(wide), dtype="<u8")
    for i, row in enumerate(wide):
        out[i] = int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(),
                                "little") & FINGERPRINT_MASK
    return out


def split_fingerprint(fp: int) -> tuple[float, float]:
    """Two 26-bit halves: sums of a few of them stay exact in the float64 all-reduce."""
    return float(fp & _HALF_MASK), float(fp >> _HALF_BITS)


def join_fingerprint(lo: float, hi: float) -> int:
    """The inverse of split_fingerprint after the halves of several ranks were summed."""
    return (int(round(lo)) + (int(round(hi)) << _HALF_BITS)) & FINGERPRINT_MASK
