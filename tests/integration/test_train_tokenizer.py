"""A trained tokenizer travels with the data and the run: the dataset and each checkpoint carry it
(a two-step training on a gloo rank), so `generate` needs nothing else."""

from __future__ import annotations

import json
import os

import pytest

from data_pipelines.tokenize_job import prepare_data
from data_pipelines.tokenizer_training import train_tokenizer
from elastic_gpt.data.tokenizers import (
    TOKENIZER_FILE,
    HFTokenizer,
)
from tests.corpora import write_python_sources


@pytest.fixture
def corpus(tmp_path):
    return write_python_sources(tmp_path / "src")


def _train_two_steps(rank: int, world: int, overrides: list[str]) -> int:
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config(None, overrides)
    return Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None).train()["step"]


def test_the_dataset_and_each_checkpoint_carry_a_trained_tokenizer(corpus, tmp_path):
    """Trained on the corpus, copied into the dataset, and from there into every checkpoint:
    once the original file and the dataset are gone, generate and export-hf still work from
    the checkpoint alone, with the same tokens."""
    import shutil

    from elastic_gpt.inference.generate import sample_text
    from elastic_gpt.inference.hf_export import export_hf
    from elastic_gpt.testing.gloo import run_gloo

    original = tmp_path / "tok.json"
    train_tokenizer(str(corpus), str(original), vocab_size=300)
    data = tmp_path / "data"
    prepare_data(str(corpus), str(data), tokenizer=str(original), seq_len=16, engine="local",
                 progress=False)
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokenizer"] == TOKENIZER_FILE
    assert (data / TOKENIZER_FILE).read_text() == original.read_text()

    ckpt = tmp_path / "ckpt"
    steps = run_gloo(_train_two_steps, 1, [
        "model.preset=tiny", f"data.path={data}", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=1",
        "scaling.min_workers=1", "scaling.max_workers=1", "eval.samples=0",
        f"checkpoint.path={ckpt}", "checkpoint.every_steps=2", "tracking.enabled=false"])
    assert steps == [2]
    step_dir = next(p for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert (step_dir / TOKENIZER_FILE).read_text() == original.read_text()
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["tokenizer"]["name"] == TOKENIZER_FILE
    marker = json.loads((step_dir / "COMMITTED.json").read_text())
    assert TOKENIZER_FILE in marker["files"]  # part of the commit: a torn copy is detected

    os.remove(original)
    shutil.rmtree(data)
    text = sample_text(str(ckpt), "def ", max_new_tokens=5, temperature=0)
    assert text.startswith("def ")
    out = tmp_path / "hf"
    export_hf(str(ckpt), str(out))
    assert (out / TOKENIZER_FILE).read_text() == (step_dir / TOKENIZER_FILE).read_text()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == HFTokenizer(str(out / TOKENIZER_FILE)).eos_token


