"""Export a checkpoint as a Hugging Face GPT-2 model directory (config.json + model.safetensors).

Our parameter names are GPT-2's, so the map is mechanical: prefix `transformer.`, and transpose
the four projection matrices, which HF stores as Conv1D weights of shape (in, out).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from elastic_gpt.inference.generate import checkpoint_tokenizer, model_at, resolve_checkpoint

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        if name.endswith(_CONV1D):
            t = t.t()
        out[f"transformer.{name}"] = t.contiguous()
    return out  # lm_head.weight is tied to transformer.wte.weight; HF re-ties it on load


def hf_config(model, eos_id: int | None = None) -> dict:
    c = model.cfg
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.seq_len, "n_ctx": c.seq_len,
        "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": None,
        "activation_function": "gelu_new",  # the tanh GELU, as in model.MLP
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


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


def export_hf(checkpoint: str, out_dir: str, overwrite: bool = False) -> str:
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
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(hf_state_dict(model), weights + ".tmp",
              metadata={"format": "pt", "elastic_gpt_step": str(state["step"])})
    for name, text in files.items():
        with open(os.path.join(out_dir, name) + ".tmp", "w") as f:
            f.write(text)
    os.replace(weights + ".tmp", weights)
    for name in files:
        os.replace(os.path.join(out_dir, name) + ".tmp", os.path.join(out_dir, name))
    return out_dir
