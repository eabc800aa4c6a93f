"""prepare-data as a Ray Data job reading and writing s3:// (the loopback S3 server): exactly the
local engine's shards, byte for byte."""

from __future__ import annotations

import hashlib

from data_pipelines.tokenize_job import prepare_data
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.stream import decode_documents
from tests.corpora import dir_digest, write_corpus


def test_ray_data_job_from_s3_matches_local_job_byte_for_byte(tmp_path, s3, ray_local):
    """The real Ray Data job reading and writing s3:// gives exactly the local engine's shards."""
    expected = write_corpus(tmp_path / "raw")
    fs = s3.filesystem()
    fs.put(str(tmp_path / "raw") + "/", "corpus/raw/", recursive=True)
    so = s3.storage_options()
    kw = dict(tokenizer="gpt2", seq_len=16, progress=False, part_bytes=150)
    s = prepare_data("s3://corpus/raw/*", "s3://corpus/ds", engine="ray", storage_options=so,
                     **kw)
    assert s["parts_built"] >= 3 and s["docs"] == len(expected)
    prepare_data(str(tmp_path / "raw") + "/*", str(tmp_path / "local"), engine="local", **kw)
    # Shards, indexes and the byte table are identical; commit markers differ only in the input
    # URLs they name.
    local = {k: v for k, v in dir_digest(tmp_path / "local").items() if k.endswith((".bin", ".idx"))}
    remote = {name: hashlib.sha256(fs.cat_file(f"corpus/ds/{name}")).hexdigest() for name in local}
    assert remote == local and len(local) == 2 * s["shards"] + 1  # + token_bytes.bin
    m = load_manifest("s3://corpus/ds", so)
    assert m.shards == load_manifest(str(tmp_path / "local")).shards
    assert decode_documents(m, so) == expected
    # A re-run finds every shard committed and builds nothing.
    assert prepare_data("s3://corpus/raw/*", "s3://corpus/ds", engine="ray", storage_options=so,
                        **kw)["parts_built"] == 0


# ----------------------------------------------------------------------------- validation split


# ----------------------------------------------------------------------------- byte counts


# ----------------------------------------------------------------------------- argument checks


