"""Each family's Hugging Face layout, without torch: the config.json a model is exported with
and read back from, and the name (and orientation) of every weight in a Hugging Face directory.

GPT-2 (`GPT2LMHeadModel`): our names under `transformer.`; its four projection matrices are
Conv1D weights, stored (in, out), the transpose of ours; the output layer is the tied
embedding. Llama (`LlamaForCausalLM`): the blocks' leaves are Hugging Face's names already
(model/llama.py), the trunk maps `wte` -> `model.embed_tokens`, `h.N` -> `model.layers.N`,
`ln_f` -> `model.norm`; `lm_head` is its own weight unless tied.

A config.json is read in either layout transformers has written for Llama: transformers 4's
top-level `rope_theta` and `rope_scaling` (the published Llama 3 directories), or
transformers 5's `rope_parameters`. What this trainer cannot build (another model type, biases
where Llama has none, a RoPE type other than Llama 3's, ...) is one ValueError line naming the
key.
"""

from __future__ import annotations

from elastic_gpt.model.config import GPTConfig, LlamaConfig, ModelConfig

HF_CONFIG = "config.json"


class HFLayoutError(ValueError):
    """A Hugging Face directory this trainer cannot build its model from."""


# ---- GPT-2 ------------------------------------------------------------------------------------

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_hf_name(name: str) -> tuple[str, bool]:
    """(the Hugging Face key of our parameter `name`, whether it is stored transposed)."""
    return f"transformer.{name}", name.endswith(_CONV1D)


def gpt2_hf_config(cfg: GPTConfig, eos_id: int | None, bos_id: int | None = None) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new",  # the tanh GELU, as in model.MLP
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def gpt2_from_hf(hf: dict, seq_len: int | None, where: str) -> GPTConfig:
    """Our GPT-2 of `hf`'s shape; `seq_len` (None: its n_positions) keeps that many learned
    positions, the first ones (positions past the training context are never used)."""
    positions = _int(hf, "n_positions", where, default=hf.get("n_ctx", 1024))
    width = _int(hf, "n_embd", where)
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where,
             "this trainer's GPT-2 MLP is the tanh GELU", default="gelu_new")
    if hf.get("n_inner") not in (None, 4 * width):
        raise HFLayoutError(f"{where}: n_inner={hf['n_inner']} is not 4 x n_embd ({4 * width}), "
                            "the MLP width GPT-2 has here; export a standard GPT-2")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            raise HFLayoutError(f"{where}: {key}=true is not GPT-2 as this trainer builds it; "
                                "use a directory without it")
    if not hf.get("tie_word_embeddings", True):
        raise HFLayoutError(f"{where}: tie_word_embeddings=false, and GPT-2's output layer is "
                            "its token embedding here; use a tied GPT-2")
    seq_len = seq_len or positions
    if seq_len > positions:
        raise HFLayoutError(f"{where}: n_positions={positions} learned positions, fewer than the "
                            f"training context of {seq_len} tokens; set model.seq_len <= "
                            f"{positions} (or prepare-data --seq-len)")
    return GPTConfig(n_layer=_int(hf, "n_layer", where), n_head=_int(hf, "n_head", where),
                     n_embd=width, seq_len=seq_len, vocab_size=_int(hf, "vocab_size", where))


# ---- Llama ------------------------------------------------------------------------------------

_LLAMA_TRUNK = (("wte.", "model.embed_tokens."), ("ln_f.", "model.norm."), ("h.", "model.layers."))


def llama_hf_name(name: str) -> tuple[str, bool]:
    for ours, theirs in _LLAMA_TRUNK:
        if name.startswith(ours):
            return theirs + name[len(ours):], False
    return name, False  # lm_head.weight


def llama_hf_config(cfg: LlamaConfig, eos_id: int | None, bos_id: int | None = None) -> dict:
    """transformers 4's layout (top-level rope_theta and rope_scaling), as the published Llama 3
    directories are written: transformers 4 and 5 both read it."""
    scaling = None if cfg.rope_factor is None else {
        "rope_type": "llama3", "factor": cfg.rope_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, cfg.rope_original_seq_len
                                       if cfg.rope_factor else cfg.seq_len),
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02,
        "bos_token_id": bos_id if bos_id is not None else eos_id, "eos_token_id": eos_id,
        "use_cache": True, "pretraining_tp": 1, "torch_dtype": "float32",
    }


def llama_from_hf(hf: dict, seq_len: int | None, where: str) -> LlamaConfig:
    """Our Llama of `hf`'s shape. `seq_len` (None: max_position_embeddings) is the training
    context: rotary positions have no table to cut, so any length up to the model's works."""
    width, heads = _int(hf, "hidden_size", where), _int(hf, "num_attention_heads", where)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFLayoutError(f"{where}: {key}=true, and Llama has no biases; this trainer "
                                "builds Llama 3 without them (use a directory without biases)")
    _require(hf, "hidden_act", ("silu",), where, "Llama's MLP is SwiGLU", default="silu")
    if hf.get("head_dim") not in (None, width // heads):
        raise HFLayoutError(f"{where}: head_dim={hf['head_dim']} is not hidden_size / "
                            f"num_attention_heads ({width // heads}); this trainer's heads "
                            "split the width")
    rope = _llama_rope(hf, where)
    positions = _int(hf, "max_position_embeddings", where, default=seq_len or 2048)
    return LlamaConfig(
        n_layer=_int(hf, "num_hidden_layers", where), n_head=heads, n_embd=width,
        seq_len=seq_len or positions, vocab_size=_int(hf, "vocab_size", where),
        n_kv_head=_int(hf, "num_key_value_heads", where, default=heads),
        ffn_hidden=_int(hf, "intermediate_size", where),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **rope)


def _llama_rope(hf: dict, where: str) -> dict:
    """LlamaConfig's rope fields from either layout: transformers 5's rope_parameters (theta
    inside), or transformers 4's rope_theta plus rope_scaling (None: plain RoPE)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))  # a map per layer type: Llama has one type
    if params is None:
        scaling = hf.get("rope_scaling") or {}
        params = {**scaling, "rope_theta": hf.get("rope_theta", 10000.0)}
    if not isinstance(params, dict):
        raise HFLayoutError(f"{where}: rope_parameters={params!r} is not a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFLayoutError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']}; "
                            "this trainer rotates whole heads (Llama 3)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta, "rope_factor": None}
    if kind != "llama3":
        raise HFLayoutError(f"{where}: rope_type={kind!r} is not supported; this trainer builds "
                            "Llama 3's RoPE (rope_type default or llama3)")
    try:
        return {"rope_theta": theta, "rope_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_seq_len": int(params["original_max_position_embeddings"])}
    except (KeyError, TypeError, ValueError) as e:
        raise HFLayoutError(f"{where}: rope_type llama3 without a usable {e}; the scaling needs "
                            "factor, low_freq_factor, high_freq_factor and "
                            "original_max_position_embeddings") from None


# ---- both ---------------------------------------------------------------------------------------


def _int(hf: dict, key: str, where: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFLayoutError(f"{where}: {key}={value!r} must be a positive integer"
                            + (" (missing)" if key not in hf else ""))
    return value


def _require(hf: dict, key: str, allowed: tuple, where: str, why: str, default) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFLayoutError(f"{where}: {key}={value!r} is not supported ({why}: "
                            f"{' or '.join(map(str, allowed))})")


def config_from_hf(hf: dict, families: dict, seq_len: int | None, where: str) -> ModelConfig:
    """The model a config.json describes, by its model_type among `families` (model_type ->
    reader)."""
    kind = hf.get("model_type")
    if kind not in families:
        raise HFLayoutError(f"{where}: model_type={kind!r} is not one this trainer builds "
                            f"({', '.join(sorted(families))}); use a GPT-2 or Llama directory")
    return families[kind](hf, seq_len, where)
