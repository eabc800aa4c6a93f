"""Held-out evaluation's data in one process: a validation set must match the training data, and
the gzip yardstick compresses exactly the evaluated text."""

from __future__ import annotations

import os
import sysconfig

import pytest

FIXTURE_DATASET = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "main-v0", "dataset")
EVAL_SAMPLES = 7  # not a multiple of the micro-batch or of W: uneven blocks, padded slots




def test_validation_set_must_match_the_training_data(dataset_with_val, tmp_path):
    from elastic_gpt.data.manifest import load_manifest, open_validation_manifest

    train = load_manifest(dataset_with_val)
    assert open_validation_manifest("", dataset_with_val, train).url.endswith("/val")
    assert open_validation_manifest("", FIXTURE_DATASET, load_manifest(FIXTURE_DATASET)) is None
    with pytest.raises(ValueError, match=r"eval\.path .* has seq_len=32 but the training data "
                                         r".* has seq_len=64; re-run prepare-data"):
        from data_pipelines.tokenize_job import prepare_data

        (tmp_path / "raw").mkdir()
        (tmp_path / "raw" / "a.txt").write_text("some text " * 100)
        prepare_data(str(tmp_path / "raw"), str(tmp_path / "long"), "bytes", 64,
                     engine="local", progress=False)
        open_validation_manifest(dataset_with_val + "/val", "", load_manifest(
            str(tmp_path / "long")))


def test_gzip_yardstick_compresses_exactly_the_evaluated_text(dataset_with_val):
    """The text behind the evaluated sequences is the held-out documents' own text, and the
    yardstick is gzip -9 of exactly that."""

    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.tokenizers import get_tokenizer
    from elastic_gpt.train.evaluate import gzip_bits_per_byte

    val = load_manifest(os.path.join(dataset_with_val, "val"))
    tok = get_tokenizer(val.tokenizer, base=val.url)
    bpb, nbytes = gzip_bits_per_byte(val, EVAL_SAMPLES, tok)
    # bytes tokenizer: one byte per target token, minus end-of-text separators
    assert 0 < nbytes <= EVAL_SAMPLES * 32
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = b"".join(open(os.path.join(stdlib, f), "rb").read()
                       for f in sorted(os.listdir(stdlib)) if f.endswith(".py"))
    from elastic_gpt.data.stream import ShardReader
    from elastic_gpt.train.evaluate import first_records
    tokens, _ = ShardReader(val).read(first_records(val, 1))
    first = bytes(int(t) for t in tokens[0, 1:] if int(t) != val.eos_id)
    assert first[:16] in sources  # the evaluated text is the held-out source text
    assert 0 < bpb < 8
