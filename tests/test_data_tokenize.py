"""prepare-data: round trip, determinism, redo-only-missing, input formats, bad input (C6)."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os

import pytest

from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.prepare import add_cli_arguments, prepare_data, run_from_args
from elastic_gpt.data.stream import decode_documents

pytest_plugins = ["elastic_gpt.testing.s3_server"]  # fixtures: s3 (loopback S3 server), ray_local

DOCS = [
    "Hello, world!\nThis is the first document.\n",
    "Ünïcödé ✓ — emoji 😀 and CJK 漢字, tabs\tand trailing spaces   \n",
    "a literal <|endoftext|> inside a document is plain text",
    "def f(x):\n    return x * 2\n" * 40,
    "short",
]


def write_corpus(root, docs=DOCS):
    """The same documents in every input format the job reads."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "a.jsonl"), "w", encoding="utf-8") as f:
        for d in docs[:2]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    with gzip.open(os.path.join(root, "b.jsonl.gz"), "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[2]}) + "\n")
    with open(os.path.join(root, "c.py"), "w", encoding="utf-8") as f:
        f.write(docs[3])
    import zstandard

    with open(os.path.join(root, "d.txt.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(docs[4].encode()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["parquet row one", "parquet row two ✓"]}),
                   os.path.join(root, "e.parquet"))
    return docs + ["parquet row one", "parquet row two ✓"]


def dir_digest(path):
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_round_trip_every_format(tmp_path, tokenizer):
    expected = write_corpus(tmp_path / "raw")
    s = prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), tokenizer, seq_len=16,
                     engine="local", progress=False, part_bytes=200)
    m = load_manifest(str(tmp_path / "ds"))
    assert m.tokenizer == tokenizer and m.seq_len == 16 and m.dtype == "uint16"
    assert len(m.shards) > 1, "small part_bytes must give several shards"
    assert decode_documents(m) == expected
    assert s["docs"] == len(expected) and m.num_samples == s["samples"]
    assert m.num_tokens == m.num_samples * 17


def test_output_is_deterministic_and_resumes_only_missing_shards(tmp_path):
    write_corpus(tmp_path / "raw")
    kw = dict(tokenizer="bytes", seq_len=8, engine="local", progress=False, part_bytes=200)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "one"), **kw)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "two"), **kw)
    first = dir_digest(tmp_path / "one")
    assert first == dir_digest(tmp_path / "two")

    # An interrupted job: one shard lost its commit marker, another is half written.
    os.remove(tmp_path / "one" / "shard-00001.done.json")
    with open(tmp_path / "one" / "shard-00002.bin", "r+b") as f:
        f.truncate(5)
    os.remove(tmp_path / "one" / "manifest.json")
    untouched = os.stat(tmp_path / "one" / "shard-00000.bin").st_mtime_ns
    s = prepare_data(str(tmp_path / "raw"), str(tmp_path / "one"), **kw)
    assert s["parts_built"] == 2 and s["parts_reused"] == (len(first) - 1) // 3 - 2
    assert os.stat(tmp_path / "one" / "shard-00000.bin").st_mtime_ns == untouched
    assert dir_digest(tmp_path / "one") == first


def test_refuses_to_replace_a_dataset_from_other_input(tmp_path):
    write_corpus(tmp_path / "raw")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("different")
    kw = dict(tokenizer="bytes", seq_len=8, engine="local", progress=False)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), **kw)
    before = dir_digest(tmp_path / "ds")
    with pytest.raises(ValueError, match="already holds a dataset.*--overwrite"):
        prepare_data(str(tmp_path / "other"), str(tmp_path / "ds"), **kw)
    assert dir_digest(tmp_path / "ds") == before
    prepare_data(str(tmp_path / "other"), str(tmp_path / "ds"), overwrite=True, **kw)
    assert decode_documents(load_manifest(str(tmp_path / "ds"))) == ["different"]


def test_bad_utf8_policies_are_counted(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "good.txt").write_text("fine text")
    (raw / "bad.txt").write_bytes(b"caf\xe9 latin-1 \xff\xfe bytes")
    kw = dict(tokenizer="bytes", seq_len=8, engine="local", progress=False)
    s = prepare_data(str(raw), str(tmp_path / "r"), **kw)
    assert s["bad_utf8_docs"] == 1 and s["bad_utf8_bytes"] == 3 and s["docs"] == 2
    assert "caf\ufffd latin-1 \ufffd\ufffd bytes" in decode_documents(
        load_manifest(str(tmp_path / "r")))
    s = prepare_data(str(raw), str(tmp_path / "s"), bad_utf8="skip", **kw)
    assert s["skipped_docs"] == 1 and s["docs"] == 1
    with pytest.raises(ValueError, match=r"bad\.txt is not valid UTF-8"):
        prepare_data(str(raw), str(tmp_path / "e"), bad_utf8="error", **kw)
    assert not (tmp_path / "e" / "manifest.json").exists()


def test_one_enormous_line_is_tokenized_in_pieces_and_round_trips(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    line = "x" * (2_500_000) + "y"  # one 2.5 MB JSON line, longer than the tokenizer piece cap
    (raw / "big.jsonl").write_text(json.dumps({"text": line}) + "\n" + '{"text": "after"}\n')
    s = prepare_data(str(raw), str(tmp_path / "ds"), "bytes", 1024, engine="local",
                     progress=False)
    assert s["split_docs"] == 1 and s["docs"] == 2
    assert decode_documents(load_manifest(str(tmp_path / "ds"))) == [line, "after"]


def test_bad_records_and_empty_corpus_are_clear_errors(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"body": "x"}\nnot json\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"has no text.*3 records had no string field 'text'.*"
                                         r"--text-field"):
        prepare_data(str(raw), str(tmp_path / "ds"), "bytes", 8, engine="local", progress=False)
    s = prepare_data(str(raw), str(tmp_path / "ds"), "bytes", 8, engine="local", progress=False,
                     text_field="body")
    assert s["docs"] == 1 and s["bad_records"] == 2
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(ValueError, match="has no text"):
        prepare_data(str(tmp_path / "empty"), str(tmp_path / "e"), "bytes", 8, engine="local",
                     progress=False)
    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), pq_dir / "x.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['content'\]\)"):
        prepare_data(str(pq_dir), str(tmp_path / "p"), "bytes", 8, engine="local",
                     progress=False)


def test_cli_prints_one_line_errors(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--input", str(tmp_path / "nope" / "*.txt"), "--output",
                              str(tmp_path / "ds"), "--engine", "local"])
    assert run_from_args(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: input") and "matched no files" in err and "\n" not in err
    args = parser.parse_args(["--input", str(tmp_path), "--output", str(tmp_path / "ds"),
                              "--tokenizer", str(tmp_path / "missing.json")])
    assert run_from_args(args) == 2
    assert "tokenizer file" in capsys.readouterr().err


def test_max_files_and_max_bytes_limit_the_job(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(6):
        (raw / f"{i}.txt").write_text(f"doc {i} " * 50)
    kw = dict(tokenizer="bytes", seq_len=8, engine="local", progress=False)
    assert prepare_data(str(raw / "*.txt"), str(tmp_path / "a"), max_files=2, **kw)["docs"] == 2
    assert prepare_data(str(raw / "*.txt"), str(tmp_path / "b"), max_bytes=1000,
                        **kw)["docs"] == 3


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("hello world hello")
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), str(tmp_path / "tokenizer.json"),
                 4, engine="local", progress=False)
    m = load_manifest(str(tmp_path / "ds"))
    assert (m.vocab_size, m.eos_id) == (4, 0)
    assert decode_documents(m) == ["hello world hello"]


@pytest.mark.slow
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
    # Shards and indexes are identical; commit markers differ only in the input URLs they name.
    local = {k: v for k, v in dir_digest(tmp_path / "local").items() if k.endswith((".bin", ".idx"))}
    remote = {name: hashlib.sha256(fs.cat_file(f"corpus/ds/{name}")).hexdigest() for name in local}
    assert remote == local and len(local) == 2 * s["shards"]
    m = load_manifest("s3://corpus/ds", so)
    assert m.shards == load_manifest(str(tmp_path / "local")).shards
    assert decode_documents(m, so) == expected
    # A re-run finds every shard committed and builds nothing.
    assert prepare_data("s3://corpus/raw/*", "s3://corpus/ds", engine="ray", storage_options=so,
                        **kw)["parts_built"] == 0


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


def test_auto_engine_uses_ray_for_big_inputs_or_a_connected_cluster(monkeypatch):
    import ray

    from elastic_gpt.data.prepare import AUTO_RAY_BYTES, choose_engine

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the ray_local fixture may be up
    assert choose_engine("auto", 10 << 20) == "local"
    assert choose_engine("auto", AUTO_RAY_BYTES) == "ray"
    assert choose_engine("local", AUTO_RAY_BYTES) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert choose_engine("auto", 1) == "ray"
