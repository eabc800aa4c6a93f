"""prepare-data as a user runs it and against storage: `python -m data_pipelines prepare` in its
own process gives the same shards as in process, and storage errors on the loopback S3 server
are one line (C6 clear errors)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from data_pipelines.tokenize_job import prepare_data
from elastic_gpt.data.manifest import load_manifest
from tests.corpora import dir_digest, write_corpus


def test_python_m_data_pipelines_prepare_is_prepare_data(tmp_path):
    """`python -m data_pipelines` lists its commands; its `prepare` takes prepare-data's
    arguments, writes the same shards as the job run in-process, and says a user error in one
    line with exit 2 (C6 clear errors)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "data_pipelines", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    usage = run("--help")
    assert usage.returncode == 0 and "prepare" in usage.stdout
    assert "train-tokenizer" in usage.stdout
    write_corpus(tmp_path / "raw")
    args = ["--input", str(tmp_path / "raw"), "--tokenizer", "bytes", "--seq-len", "16",
            "--part-bytes", "200", "--val-docs", "2", "--no-progress"]
    done = run("prepare", "--output", str(tmp_path / "ds"), *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prepared {tmp_path / 'ds'}: ")
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ref"), "bytes", 16, part_bytes=200,
                 val_docs=2, engine="local", progress=False)
    shards = {k: v for k, v in dir_digest(tmp_path / "ds").items() if k.endswith((".bin", ".idx"))}
    assert shards and shards == {k: v for k, v in dir_digest(tmp_path / "ref").items()
                                 if k.endswith((".bin", ".idx"))}
    bad = run("prepare", "--input", str(tmp_path / "nothing-*.txt"), "--output",
              str(tmp_path / "bad"), "--tokenizer", "bytes")
    err = bad.stderr.strip()
    assert bad.returncode == 2 and "\n" not in err, err
    assert err.startswith("data_pipelines prepare: error: ") and "matched no files" in err


def test_storage_errors_are_one_line(s3):
    so = s3.storage_options()
    with pytest.raises(ValueError, match="s3://missing-bucket/raw does not exist"):
        prepare_data("s3://missing-bucket/raw", "s3://corpus/ds", "bytes", engine="local",
                     storage_options=so)
    with pytest.raises(ValueError, match="not a prepared dataset"):
        load_manifest("s3://corpus/nothing-here", so)
    s3.filesystem().pipe("corpus/creds/a.txt", b"text")
    with s3.enforce_credentials(), pytest.raises(ValueError, match="denied.*credentials"):
        prepare_data("s3://corpus/creds", "s3://corpus/ds", "bytes", engine="local",
                     storage_options=s3.storage_options("AKIDWRONG", "wrong"))


# ----------------------------------------------------------------------------- validation split


# ----------------------------------------------------------------------------- byte counts


# ----------------------------------------------------------------------------- argument checks


