"""The corpus-trained BPE tokenizer (data_pipelines/tokenizer_training.py) and how a folder carries
a tokenizer (save_tokenizer / get_tokenizer(base=...))."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_pipelines.recipes import stdlib as stdlib_recipe
from data_pipelines.tokenize_job import prepare_data
from data_pipelines.tokenizer_training import iter_training_documents, main, train_tokenizer
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.token_bytes import token_byte_lengths
from elastic_gpt.data.tokenizers import (
    EOT_TEXT,
    TOKENIZER_FILE,
    HFTokenizer,
    get_tokenizer,
    save_tokenizer,
)
from tests.corpora import PYTHON_SOURCES, write_python_sources


@pytest.fixture
def corpus(tmp_path):
    return write_python_sources(tmp_path / "src")


def test_round_trip_and_exact_bytes(corpus, tmp_path):
    out = tmp_path / "tok.json"
    s = train_tokenizer(f"file://{corpus}/*.py", str(out), vocab_size=400)
    assert s["docs"] == len(PYTHON_SOURCES) and s["vocab_size"] <= 400
    tok = get_tokenizer(str(out))
    assert isinstance(tok, HFTokenizer) and tok.eos_id == json.loads(out.read_text())[
        "added_tokens"][0]["id"]
    table = token_byte_lengths(tok)
    for text in [*PYTHON_SOURCES, "never seen: ∑ 𝔘 \x00\r\n  \t", EOT_TEXT]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids  # a literal end-of-text in a document is text
        assert int(table[np.asarray(ids)].sum()) == len(text.encode("utf-8"))  # exact bits/byte
    # indentation and newlines are learnt as tokens, not spent space by space
    assert len(tok.encode("\n        self.x = x")) < len("\n        self.x = x") / 2


def test_deterministic(corpus, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for p in (a, b):
        train_tokenizer(str(corpus), str(p), vocab_size=350)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("split", [dict(val_fraction=0.3), dict(val_docs=5)])
def test_leaves_out_what_prepare_data_holds_out(corpus, tmp_path, split):
    """The documents the tokenizer learns from are exactly prepare-data's training split."""
    seen = list(iter_training_documents(f"{corpus}/*.py", val_seed=7, **split))
    held_out = list(iter_training_documents(f"{corpus}/*.py", val_seed=7, validation=True,
                                            **split))
    out = tmp_path / "ds"
    summary = prepare_data(f"{corpus}/*.py", str(out), "bytes", 16, progress=False,
                           engine="local", val_seed=7, **split)
    assert 0 < summary["val"]["docs"] and len(seen) == summary["docs"]
    assert len(seen) + summary["val"]["docs"] == len(PYTHON_SOURCES)
    tok = get_tokenizer("bytes")
    val_text = _dataset_text(out / "val", tok)
    held = [t for t in PYTHON_SOURCES if t not in seen]
    assert held and sorted(held) == sorted(held_out) and all(t in val_text for t in held)
    assert not any(t in val_text for t in seen if t not in held)


def _dataset_text(path, tok) -> str:
    from elastic_gpt.data.manifest import load_manifest

    m = load_manifest(str(path))
    text = []
    for k in range(len(m.shards)):
        recs = np.fromfile(m.shard_url(k), dtype=m.dtype).reshape(-1, m.record_tokens)
        stream = np.concatenate([recs[0], *[r[1:] for r in recs[1:]]]) if len(recs) else []
        text.append(tok.decode(stream))
    return "".join(text)


def test_a_folder_carries_its_tokenizer(corpus, tmp_path):
    train_tokenizer(str(corpus), str(tmp_path / "tok.json"), vocab_size=300)
    tok = get_tokenizer(str(tmp_path / "tok.json"))
    folder = tmp_path / "ckpt" / "step_10"
    folder.mkdir(parents=True)
    name = save_tokenizer(tok, f"file://{folder}")
    assert name == TOKENIZER_FILE and (folder / TOKENIZER_FILE).exists()
    again = get_tokenizer(name, base=f"file://{folder}")
    assert again.encode(PYTHON_SOURCES[1]) == tok.encode(PYTHON_SOURCES[1]) and again.eos_id == tok.eos_id
    # the built-in tokenizers ship with the package: nothing is written, the name is recorded
    assert save_tokenizer(get_tokenizer("gpt2"), str(tmp_path / "none")) == "gpt2"
    assert save_tokenizer(get_tokenizer("bytes"), str(tmp_path / "none")) == "bytes"
    assert not (tmp_path / "none").exists()
    assert get_tokenizer("gpt2", base=str(folder)).name == "gpt2"


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nothing-*.py"), "--output",
                 str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train_tokenizer: error:") and "\n" not in err
    assert main(["--input", str(tmp_path), "--output", str(tmp_path / "t.json"),
                 "--vocab-size", "100"]) == 2
    assert "--vocab-size" in capsys.readouterr().err


def test_a_prompt_ending_in_a_space_is_healed(corpus, tmp_path):
    """`def ` is encoded as `def` and the first new token must begin with the space: the BPE
    keeps a word's leading space in the word's token (` name`), never as a lone space before it."""
    from elastic_gpt.inference.generate import heal_prompt, tokens_starting_with

    train_tokenizer(str(corpus), str(tmp_path / "tok.json"), vocab_size=300)
    tok = get_tokenizer(str(tmp_path / "tok.json"))
    assert heal_prompt("def ") == ("def", " ") and heal_prompt("def") == ("def", "")
    assert heal_prompt("   ") == ("   ", "")  # nothing left to encode: kept as typed
    allowed = tokens_starting_with(tok, " ", tok.vocab_size + 20)
    word = next(i for i in tok.encode("def f(x):\n    return x") if tok.decode([i]) == " return")
    assert allowed[word] and not allowed[tok.encode("def")[0]]
    assert not allowed[tok.vocab_size:].any()  # padding rows are never sampled


def test_stdlib_recipe_makes_what_the_two_make_steps_made(tmp_path, capsys, monkeypatch):
    """`python -m data_pipelines.recipes.stdlib` (what `make data` runs) learns the tokenizer as
    `train-tokenizer --vocab-size 4096 --val-fraction 0.05` does, and prepares the dataset of
    `prepare-data --tokenizer <abs path> --seq-len 256 --val-fraction 0.05` (the same job key, so
    a dataset an older `make data` wrote is reused); a re-run keeps the tokenizer file and every
    shard."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(80):  # enough files for 5% to hold some out
        (lib / f"m{i:02d}.py").write_text(PYTHON_SOURCES[i % len(PYTHON_SOURCES)] + f"X = {i}\n",
                                         encoding="utf-8")
    (lib / "notes.txt").write_text("not a module: only *.py is the corpus")
    monkeypatch.chdir(tmp_path)
    argv = ["--stdlib", str(lib), "--output", "out/ds", "--tokenizer-output", "out/tok.json",
            "--no-progress"]
    assert stdlib_recipe.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("trained out/tok.json: ") and f"prepared {tmp_path}/out/ds: " in out
    corpus = f"file://{lib}/*.py"
    train_tokenizer(corpus, str(tmp_path / "ref.json"), vocab_size=4096, val_fraction=0.05)
    assert (tmp_path / "ref.json").read_bytes() == (tmp_path / "out" / "tok.json").read_bytes()
    made = load_manifest(str(tmp_path / "out" / "ds"))
    ref = prepare_data(corpus, str(tmp_path / "ref"), str(tmp_path / "out" / "tok.json"), 256,
                       val_fraction=0.05, engine="local", progress=False)
    assert made.seq_len == 256 and made.source["input"] == corpus
    assert made.source["job_key"] == load_manifest(str(tmp_path / "ref")).source["job_key"]
    assert made.source["files"] == 80 and ref["val"]["docs"] > 0
    assert (tmp_path / "out" / "ds" / "val" / "manifest.json").exists()
    mtime = os.stat(tmp_path / "out" / "tok.json").st_mtime_ns
    assert stdlib_recipe.main(argv) == 0
    again = capsys.readouterr().out
    assert "trained" not in again and "every shard was already committed" in again
    assert os.stat(tmp_path / "out" / "tok.json").st_mtime_ns == mtime
