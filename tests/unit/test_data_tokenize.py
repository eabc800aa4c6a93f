"""prepare-data in this process: the round trip of every input format, determinism, redoing only
what is missing, the held-out split, and bad input (C6 clear errors)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from data_pipelines.cli import add_cli_arguments, run_from_args
from data_pipelines.tokenize_job import prepare_data
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.stream import decode_documents
from tests.corpora import dir_digest, write_corpus


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


def test_cli_errors_are_one_line_value_errors(tmp_path, capsys):
    """run_from_args raises ValueError("<what>; <how to fix>"); the CLI prints it as
    `elastic-gpt prepare-data: error: ...` and exits 2."""
    from elastic_gpt.cli import main

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--input", str(tmp_path / "nope" / "*.txt"), "--output",
                              str(tmp_path / "ds"), "--engine", "local"])
    with pytest.raises(ValueError, match="matched no files"):
        run_from_args(args)
    assert main(["prepare-data", "--input", str(tmp_path), "--output", str(tmp_path / "ds"),
                 "--tokenizer", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-gpt prepare-data: error: tokenizer file") and "\n" not in err


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


def test_auto_engine_uses_ray_for_big_inputs_or_a_connected_cluster(monkeypatch):
    import ray

    from data_pipelines.engines import AUTO_RAY_BYTES, choose_engine

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the ray_local fixture may be up
    assert choose_engine("auto", 10 << 20) == "local"
    assert choose_engine("auto", AUTO_RAY_BYTES) == "ray"
    assert choose_engine("local", AUTO_RAY_BYTES) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert choose_engine("auto", 1) == "ray"


# ----------------------------------------------------------------------------- validation split

def _many_docs(root, n=60):
    """n documents in JSONL files of 10 each (so part sizes can cut them differently)."""
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        with open(os.path.join(root, f"docs{i // 10:02d}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"text": f"document {i}: " + "ünï ✓ text " * (i % 7 + 1)}) + "\n")
    return [f"document {i}: " + "ünï ✓ text " * (i % 7 + 1) for i in range(n)]


def test_validation_split_is_deterministic_disjoint_and_whole_documents(tmp_path):
    docs = _many_docs(tmp_path / "raw")
    kw = dict(tokenizer="bytes", seq_len=16, progress=False, val_fraction=0.25, val_seed=3)
    s = prepare_data(str(tmp_path / "raw"), str(tmp_path / "a"), engine="local", part_bytes=300,
                     **kw)
    train = decode_documents(load_manifest(str(tmp_path / "a")))
    val = decode_documents(load_manifest(str(tmp_path / "a" / "val")))
    assert sorted(train + val) == sorted(docs), "every document once, whole, on one side"
    assert not set(train) & set(val) and 5 <= len(val) <= 25
    assert s["val"]["docs"] == len(val) and s["docs"] == len(train)
    # The split is a function of the text and the seed only: another part size (so other
    # shards and another number of parts) holds out the same documents.
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "b"), engine="local", part_bytes=5000,
                 **kw)
    assert sorted(decode_documents(load_manifest(str(tmp_path / "b" / "val")))) == sorted(val)
    # Another seed holds out other documents.
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "c"), engine="local",
                 **{**kw, "val_seed": 4})
    assert sorted(decode_documents(load_manifest(str(tmp_path / "c" / "val")))) != sorted(val)
    m, mv = load_manifest(str(tmp_path / "a")), load_manifest(str(tmp_path / "a" / "val"))
    assert (mv.tokenizer, mv.seq_len, mv.vocab_size) == (m.tokenizer, m.seq_len, m.vocab_size)


def test_val_docs_holds_out_exactly_that_many_documents(tmp_path):
    docs = _many_docs(tmp_path / "raw")
    kw = dict(tokenizer="bytes", seq_len=16, engine="local", progress=False, val_docs=4)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "a"), part_bytes=300, **kw)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "b"), part_bytes=5000, **kw)
    val = decode_documents(load_manifest(str(tmp_path / "a" / "val")))
    train = decode_documents(load_manifest(str(tmp_path / "a")))
    assert len(val) == 4 and sorted(val + train) == sorted(docs)
    assert sorted(decode_documents(load_manifest(str(tmp_path / "b" / "val")))) == sorted(val)
    with pytest.raises(ValueError, match="--val-docs 60 would hold out all 60 documents"):
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "c"), **{**kw, "val_docs": 60})
    with pytest.raises(ValueError, match="keep one"):
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "c"), val_fraction=0.1,
                     **{**kw, "val_docs": 2})


def test_validation_split_resumes_and_refuses_an_empty_split(tmp_path):
    _many_docs(tmp_path / "raw")
    kw = dict(tokenizer="bytes", seq_len=16, engine="local", progress=False, part_bytes=300,
              val_fraction=0.25)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "a"), **kw)
    first = dir_digest(tmp_path / "a")
    os.remove(tmp_path / "a" / "val" / "shard-00001.bin")  # lost: the part is redone
    s = prepare_data(str(tmp_path / "raw"), str(tmp_path / "a"), **kw)
    assert s["parts_built"] == 1
    assert dir_digest(tmp_path / "a") == first
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x.txt").write_text("a single document")
    with pytest.raises(ValueError, match="held out none.*raise --val-fraction"):
        prepare_data(str(tmp_path / "one"), str(tmp_path / "b"), "bytes", 8, engine="local",
                     progress=False, val_fraction=0.01)
    with pytest.raises(ValueError, match=r"--val-fraction must be in \[0, 1\)"):
        prepare_data(str(tmp_path / "one"), str(tmp_path / "b"), "bytes", 8, val_fraction=1.5)


def test_separate_validation_input(tmp_path):
    docs = _many_docs(tmp_path / "raw", 10)
    (tmp_path / "heldout").mkdir()
    (tmp_path / "heldout" / "v.txt").write_text("a validation document ✓")
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), "bytes", 16, engine="local",
                 progress=False, val_input=str(tmp_path / "heldout"))
    assert decode_documents(load_manifest(str(tmp_path / "ds"))) == docs
    assert decode_documents(load_manifest(str(tmp_path / "ds" / "val"))) == [
        "a validation document ✓"]


# ----------------------------------------------------------------------------- byte counts

@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_byte_counts_equal_the_decoded_texts_utf8_length(tmp_path, tokenizer):
    """A record's byte count is the UTF-8 length of the text its target tokens (positions
    1..seq_len, what the loss is taken over) stand for; end-of-text counts 0."""
    from elastic_gpt.data.stream import read_shard_stream
    from elastic_gpt.data.tokenizers import get_tokenizer

    expected = write_corpus(tmp_path / "raw")
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), tokenizer, seq_len=16,
                 engine="local", progress=False, part_bytes=200)
    m = load_manifest(str(tmp_path / "ds"))
    table = m.load_token_bytes()
    assert m.version == 2 and m.has_byte_counts and table[m.eos_id] == 0
    tok = get_tokenizer(tokenizer)
    first_tokens = 0  # each shard's first token is an input only, never a target
    for k, shard in enumerate(m.shards):
        stream = read_shard_stream(m, k)
        first_tokens += int(table[stream[0]])
        targets = [stream[i * 16 + 1:i * 16 + 17] for i in range(shard.num_samples)]
        assert sum(int(table[t].sum()) for t in targets) == shard.text_bytes
        for t in targets:  # the text each record's targets decode to, byte for byte
            ids = [int(i) for i in t if int(i) != m.eos_id]
            text = tok.decode(ids) if ids else ""
            if "\ufffd" not in text:  # a record boundary can cut a character in two
                assert int(table[t].sum()) == len(text.encode("utf-8"))
    total = sum(len(d.encode("utf-8")) for d in expected)
    assert m.stats["text_bytes"] + first_tokens == total


def test_tokenizer_without_fixed_bytes_has_no_byte_counts(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are dropped: no fixed bytes
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("hello world hello")
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), str(tmp_path / "tokenizer.json"),
                 4, engine="local", progress=False)
    m = load_manifest(str(tmp_path / "ds"))
    assert not m.has_byte_counts and m.load_token_bytes() is None


def test_version_1_manifest_still_loads_without_byte_counts():
    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "main-v0", "dataset")
    m = load_manifest(fixture)
    assert m.version == 1 and not m.has_byte_counts and m.load_token_bytes() is None


# ----------------------------------------------------------------------------- argument checks

def test_binary_input_is_refused_unless_allowed(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40)
    (raw / "ok.txt").write_text("plain text")
    with pytest.raises(ValueError, match=r"image\.txt looks binary.*--allow-binary"):
        prepare_data(str(raw), str(tmp_path / "a"), "bytes", 8, engine="local", progress=False)
    assert not (tmp_path / "a" / "manifest.json").exists()
    s = prepare_data(str(raw), str(tmp_path / "a"), "bytes", 8, engine="local", progress=False,
                     allow_binary=True)
    assert s["docs"] == 2
    noisy = tmp_path / "noisy"
    noisy.mkdir()  # latin-1 prose: a few bad bytes is text (replaced and counted), not binary
    (noisy / "fr.txt").write_bytes("Le café était très agréable. ".encode("latin-1") * 20)
    assert prepare_data(str(noisy), str(tmp_path / "b"), "bytes", 8, engine="local",
                        progress=False)["bad_utf8_docs"] == 1
    from data_pipelines.sources import looks_binary

    assert looks_binary(b"abc\x00def") and looks_binary(bytes(range(128, 256)) * 4)
    assert looks_binary("ünïcödé ✓".encode() * 100) is None


def test_seq_len_longer_than_every_document_warns(tmp_path, caplog):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("short document")
    with caplog.at_level("WARNING", logger="data_pipelines.tokenize_job"):
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds"), "bytes", 4096,
                     engine="local", progress=False)
    lines = [r.getMessage() for r in caplog.records if "--seq-len" in r.getMessage()]
    assert len(lines) == 1 and "longest document (14 tokens)" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="data_pipelines.tokenize_job"):
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "ds2"), "bytes", 8,
                     engine="local", progress=False)
    assert not [r for r in caplog.records if "--seq-len" in r.getMessage()]


def test_output_problems_name_the_output(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("text")
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"--output .*a_file is an existing file"):
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "a_file"), "bytes", 8,
                     engine="local", progress=False)
    with pytest.raises(ValueError, match=r"output directory /proc/x/data .*writable --output"):
        prepare_data(str(tmp_path / "raw"), "/proc/x/data", "bytes", 8, engine="local",
                     progress=False)
