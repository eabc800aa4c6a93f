"""Export a checkpoint as a Hugging Face GPT-2 model directory (config.json + model.safetensors).

Our parameter names are GPT-2's, so the map is mechanical: prefix `transformer.`, and transpose
the four projection matrices, which HF stores as Conv1D weights of shape (in, out).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from elastic_gpt.inference.generate import load_model

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


def export_hf(checkpoint: str, out_dir: str) -> str:
    model, state = load_model(checkpoint)
    os.makedirs(out_dir, exist_ok=True)
    eos = None
    try:
        from elastic_gpt.data.manifest import load_manifest
        eos = load_manifest(state["data"]["url"]).eos_id
    except (ValueError, OSError, KeyError):
        pass  # the dataset may be gone; the weights are still exportable
    save_file(hf_state_dict(model), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt", "elastic_gpt_step": str(state["step"])})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(model, eos), f, indent=1)
    return out_dir
