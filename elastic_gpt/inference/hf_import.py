"""`elastic-gpt import-hf DIR --out CKPT`: a Hugging Face model directory (GPT-2 or Llama,
config.json in transformers 4's or 5's layout, safetensors in one file or shards) as a step-0
checkpoint under CKPT, which a run with `checkpoint.path=CKPT` resumes at any (dp, tp, pp)
layout, so pretraining continues from the published weights on the run's own data.

The checkpoint holds the weights only: the optimizer starts fresh, as at any step 0 (its
trainer_state.json says so), and the run's MLflow run is its own. It carries the directory's
tokenizer.json when there is one, so `generate` and `export-hf` work from it alone. The model is
read into this one process; a model larger than this host's memory starts instead from
`checkpoint.init_from=DIR`, where each rank reads only its shards' slices.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from elastic_gpt.checkpoint.hf_weights import (
    TOKENIZER,
    hf_directory_config,
    load_hf_weights,
    read_hf_config,
)
from elastic_gpt.checkpoint.sharded import save_sharded
from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
from elastic_gpt.model.families import build_model

IMPORTED_STEP = 0


def import_hf(directory: str, out: str, seq_len: int | None = None) -> tuple[str, object]:
    """Write `directory`'s model as the step-0 checkpoint of the checkpoint root `out`; returns
    (its URL, the model's config). `seq_len`: the context the run trains at (None: the
    directory's; a Llama checkpoint resumes at any, a GPT-2 one at its learned positions')."""
    import torch

    cfg = hf_directory_config(directory, seq_len)
    store = CheckpointStore(out)
    if store.step_dirs():
        first = step_dirname(min(store.step_dirs()))
        raise ValueError(f"--out {out} already holds checkpoints ({first}, ...); name a new "
                         "checkpoint root")
    store.check_writable()
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    load_hf_weights(model, directory)
    store.prepare_step_dir(IMPORTED_STEP)
    url = store.url(step_dirname(IMPORTED_STEP))
    save_sharded(url, model, None)
    tokenizer = _copy_tokenizer(directory, store)
    store.commit(IMPORTED_STEP, {
        "step": IMPORTED_STEP, "samples_seen": 0, "epoch": 0, "world_size": 1, "tp": 1,
        "mlflow_run_id": None, "model_shape": cfg.shape(), "optimizer": False,
        "imported_from": os.path.abspath(directory), "tokenizer": tokenizer,
        "saved_at": time.time()})
    return url, cfg


def _copy_tokenizer(directory: str, store: CheckpointStore) -> dict | None:
    """The directory's tokenizer.json into the step folder, and what trainer_state records of it
    (its end-of-text id from config.json), or None without one."""
    source = os.path.join(directory, TOKENIZER)
    if not os.path.isfile(source):
        return None
    from elastic_gpt.data.tokenizers import HFTokenizer

    hf = read_hf_config(directory)
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    with open(source, "rb") as src, store.fs.open(store.path(step_dirname(IMPORTED_STEP),
                                                             TOKENIZER), "wb") as dst:
        shutil.copyfileobj(src, dst)
    tok = HFTokenizer(source)
    return {"name": TOKENIZER, "eos_id": int(eos) if isinstance(eos, int) else tok.eos_id,
            "vocab_size": tok.vocab_size}


def training_overrides(cfg) -> str:
    """The model.* keys a run needs to resume the imported checkpoint, as one line to paste: a
    preset's name when the model is one (the published shapes), else each key; "" when the
    config cannot say it (a RoPE scaling other than Llama 3.1's standard one), where
    checkpoint.init_from=DIR is the way."""
    import dataclasses

    from elastic_gpt.config import FAMILY_KEYS
    from elastic_gpt.model.config import PRESET_FAMILY, PRESETS, make_config, preset_config

    keys: dict[str, object] = {}
    for name in PRESETS:
        if PRESET_FAMILY[name] == cfg.family and preset_config(
                name, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size) == cfg:
            keys = {"model.preset": name, "model.vocab_size": cfg.vocab_size}
            break
    else:
        shape = cfg.shape()
        keys = {"model.family": cfg.family, "model.n_layer": cfg.n_layer,
                "model.n_head": cfg.n_head, "model.n_embd": cfg.n_embd,
                "model.vocab_size": cfg.vocab_size}
        for key, field in FAMILY_KEYS.items():
            if field in shape:
                keys[f"model.{key}"] = (shape[field] is not None if key == "rope_scaling"
                                        else shape[field])
        # what those keys build (model.rope_scaling turns on the standard scaling only)
        fields = {k: v for k, v in shape.items() if k != "family"}
        if "rope_factor" in fields and fields["rope_factor"] is not None:
            standard = make_config(cfg.family, {**fields, "rope_factor": 8.0,
                                                "rope_low_freq_factor": 1.0,
                                                "rope_high_freq_factor": 4.0,
                                                "rope_original_seq_len": 8192})
            if dataclasses.replace(standard, dropout=cfg.dropout) != cfg:
                return ""
    if "seq_len" not in cfg.free_fields:
        keys["model.seq_len"] = cfg.seq_len
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in keys.items())
