"""Export a checkpoint as a Hugging Face model directory: config.json and safetensors weights
(one model.safetensors, or shards with a model.safetensors.index.json when larger than a shard),
loadable by the family's transformers class (`GPT2LMHeadModel`, `LlamaForCausalLM`).

The key of each weight and the config.json are the family's (model/families.py, its Hugging
Face layout in model/hf_layouts.py): GPT-2's names under `transformer.` with its Conv1D
projections transposed, Llama's trunk renamed and its blocks as they are. A tied output layer
is not written: transformers ties it again on load.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from elastic_gpt.checkpoint.hf_weights import WEIGHTS, WEIGHTS_INDEX
from elastic_gpt.inference.generate import checkpoint_tokenizer, model_at, resolve_checkpoint
from elastic_gpt.model.families import spec_of

MAX_SHARD_BYTES = 5 * 1024 ** 3
"""A weights file holds at most this many bytes (transformers' default shard size); a larger
model is written as model-0000k-of-0000n.safetensors files and an index."""


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight under its Hugging Face key, in its orientation, fp32 on the CPU."""
    spec = spec_of(model.cfg)
    out = {}
    for name, t in model.state_dict().items():
        key, transposed = spec.hf_name(name)
        t = t.detach().float().cpu()
        out[key] = (t.t() if transposed else t).contiguous()
    return out


def hf_config(model, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    return spec_of(model.cfg).hf_config(model.cfg, eos_id, bos_id)


def shard_files(tensors: dict[str, torch.Tensor], max_bytes: int = MAX_SHARD_BYTES,
                ) -> dict[str, dict[str, torch.Tensor]]:
    """The weights split into files of at most `max_bytes` each (a tensor larger than that gets
    a file of its own), named as transformers names them; one model.safetensors if it fits."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = t
        size += n
    if len(groups) == 1:
        return {WEIGHTS: groups[0]}
    count = len(groups)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": g for i, g in enumerate(groups)}


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    """--out must be a folder we may fill: new, empty, or (with --overwrite) an earlier export.
    Checked before the checkpoint is read, and without leaving a folder behind."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir} is a file, not a folder; name a new folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"--out {out_dir} is not empty ({', '.join(sorted(os.listdir(out_dir))[:3])}"
                         f"{', ...' if len(os.listdir(out_dir)) > 3 else ''}); name a new folder, "
                         "or pass --overwrite to replace an earlier export there")
    made, d = [], os.path.abspath(out_dir)
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".elastic-gpt-write-probe")
        open(probe, "w").close()
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--out {out_dir} cannot be written ({e.strerror or e}); choose a "
                         "writable folder") from None
    finally:
        for d in made:  # innermost first: the export makes them again once the model is read
            try:
                os.rmdir(d)
            except OSError:
                pass


def export_hf(checkpoint: str, out_dir: str, overwrite: bool = False,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Export the newest (or the named) checkpoint into `out_dir`; each file is written to a
    temporary name and renamed, so a failed export leaves no half-written model. A
    tokenizer.json tokenizer goes with it (with a tokenizer_config.json, so
    transformers.AutoTokenizer.from_pretrained(out_dir) reads it)."""
    check_output_dir(out_dir, overwrite)
    step_url, state = resolve_checkpoint(checkpoint)
    model = model_at(step_url, state)
    os.makedirs(out_dir, exist_ok=True)
    tok = eos = None
    try:
        tok, eos = checkpoint_tokenizer(step_url, state)
    except (ValueError, OSError, KeyError):
        pass  # an old checkpoint whose dataset is gone: the weights are still exportable
    files = {"config.json": json.dumps(hf_config(model, eos), indent=1)}
    if tok is not None and hasattr(tok, "to_str"):
        files["tokenizer.json"] = tok.to_str()
        files["tokenizer_config.json"] = json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
            "bos_token": tok.eos_token, "model_max_length": model.cfg.seq_len}, indent=1)
    weights = shard_files(hf_state_dict(model), max_shard_bytes)
    del model
    if len(weights) > 1:
        files[WEIGHTS_INDEX] = json.dumps({
            "metadata": {"total_size": sum(t.numel() * t.element_size()
                                           for g in weights.values() for t in g.values())},
            "weight_map": {key: name for name, g in weights.items() for key in g}}, indent=1)
    metadata = {"format": "pt", "elastic_gpt_step": str(state["step"])}
    for name, tensors in weights.items():
        save_file(tensors, os.path.join(out_dir, name) + ".tmp", metadata=metadata)
    for name, text in files.items():
        with open(os.path.join(out_dir, name) + ".tmp", "w") as f:
            f.write(text)
    # Weights, then config.json last: a directory with a config.json is a complete export.
    for name in [*weights, *(n for n in files if n != "config.json"), "config.json"]:
        os.replace(os.path.join(out_dir, name) + ".tmp", os.path.join(out_dir, name))
    stale = {WEIGHTS, WEIGHTS_INDEX} - set(weights) - set(files)
    for name in stale:  # an earlier export's other layout (with --overwrite)
        if os.path.exists(os.path.join(out_dir, name)):
            os.unlink(os.path.join(out_dir, name))
    return out_dir


def architecture(checkpoint: str) -> str:
    """The transformers class an export of `checkpoint` loads with (for the CLI's line)."""
    from elastic_gpt.model.config import config_from_shape

    _, state = resolve_checkpoint(checkpoint)
    return spec_of(config_from_shape(state["model_shape"])).hf_architecture
