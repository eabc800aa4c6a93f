"""The model shape a run trains: the config's preset, family and model.* keys, completed from the
dataset; or, with checkpoint.init_from, the Hugging Face directory's shape.

The driver's preflight and the planner call this as the workers do, so all of them agree on the
shape, and on whether parallel.tp and parallel.pp can split it; it imports neither the Trainer nor
torch.distributed.
"""

from __future__ import annotations

from elastic_gpt.checkpoint.hf_weights import hf_directory_config
from elastic_gpt.config import FAMILY_KEYS, Config
from elastic_gpt.model.config import PRESET_FAMILY, PRESETS, ModelConfig, make_config, pad_vocab
from elastic_gpt.parallel.tp_rules import model_problem

ROPE_SCALING_OFF = {"rope_factor": None}


def model_config_for(cfg: Config, manifest) -> ModelConfig:
    """Preset shape in the preset's family (or model.family), then explicit model.* keys;
    seq_len and vocab come from the data if unset. With checkpoint.init_from: the directory's."""
    m = cfg.model
    if cfg.checkpoint.init_from:
        gpt = _from_hf_directory(cfg, manifest)
    else:
        family = m.family or PRESET_FAMILY[m.preset]
        fields = dict(PRESETS[m.preset])
        fields.update(_explicit_shape_keys(cfg))
        fields["seq_len"] = m.seq_len or manifest.seq_len
        fields["vocab_size"] = m.vocab_size or pad_vocab(manifest.vocab_size)
        manifest.check_model(fields["vocab_size"])
        gpt = make_config(family, {**fields, "dropout": m.dropout})
    if manifest.seq_len < gpt.seq_len:
        raise ValueError(f"dataset samples have {manifest.seq_len} tokens but model.seq_len="
                         f"{gpt.seq_len}; unset model.seq_len or re-run prepare-data with "
                         f"--seq-len {gpt.seq_len}")
    check_tensor_parallel(gpt, cfg.parallel.tp)
    stages = cfg.parallel.pp * cfg.parallel.pp_stages_per_rank
    if stages > gpt.n_layer:
        raise ValueError(f"parallel.pp={cfg.parallel.pp} x parallel.pp_stages_per_rank="
                         f"{cfg.parallel.pp_stages_per_rank} stages need at least one block each, "
                         f"and the model has {gpt.n_layer}; use at most {gpt.n_layer} stages or "
                         "a deeper model (model.n_layer)")
    return gpt


def _explicit_shape_keys(cfg: Config) -> dict:
    """The model.* keys set in the config, as shape fields."""
    m = cfg.model
    out = {k: v for k, v in dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd).items()
           if v is not None}
    for key, field in FAMILY_KEYS.items():
        value = getattr(m, key)
        if value is None:
            continue
        if key == "rope_scaling":
            if not value:
                out.update(ROPE_SCALING_OFF)
        else:
            out[field] = value
    return out


def _from_hf_directory(cfg: Config, manifest) -> ModelConfig:
    """The init_from directory's model at the run's context (model.seq_len, else the data's),
    with its vocabulary; a model.* key that disagrees with the directory is refused."""
    gpt = hf_directory_config(cfg.checkpoint.init_from, cfg.model.seq_len or manifest.seq_len,
                              dropout=cfg.model.dropout)
    shape = gpt.shape()
    given = {**_explicit_shape_keys(cfg), **({"family": cfg.model.family} if cfg.model.family
                                              else {}),
             **({"vocab_size": cfg.model.vocab_size} if cfg.model.vocab_size else {})}
    for key, value in given.items():
        have = shape.get(key, gpt.family if key == "family" else None)
        if have != value:
            raise ValueError(f"model.{_key_name(key)}={value} disagrees with checkpoint.init_from="
                             f"{cfg.checkpoint.init_from}, whose model has {key}={have}; unset "
                             f"model.{_key_name(key)} (the directory sets the shape)")
    check_tokenizer_matches(cfg.checkpoint.init_from, manifest, gpt.vocab_size)
    return gpt


def _key_name(field: str) -> str:
    return {v: k for k, v in FAMILY_KEYS.items()}.get(field, field)


def check_tokenizer_matches(directory: str, manifest, vocab_size: int) -> None:
    """The dataset must be tokenized with the model's tokenizer: ids past the model's
    vocabulary, or another tokenizer's ids where the directory ships one, would train on
    garbage."""
    from elastic_gpt.checkpoint.hf_weights import directory_tokenizer_vocab

    if manifest.vocab_size > vocab_size:
        raise ValueError(f"dataset {manifest.url} has a vocabulary of {manifest.vocab_size} ids "
                         f"and checkpoint.init_from={directory} a model of {vocab_size}; "
                         "re-tokenize the data with the directory's tokenizer (prepare-data "
                         f"--tokenizer {directory}/tokenizer.json)")
    theirs = directory_tokenizer_vocab(directory)
    if theirs is not None and theirs != manifest.vocab_size:
        raise ValueError(f"dataset {manifest.url} was tokenized with {manifest.tokenizer!r} "
                         f"({manifest.vocab_size} ids), not checkpoint.init_from's tokenizer "
                         f"({theirs} ids); re-tokenize the data with prepare-data --tokenizer "
                         f"{directory}/tokenizer.json")


def check_tensor_parallel(gpt: ModelConfig, tp: int) -> None:
    """parallel.tp splits this model (`tp_rules.model_problem`), or ValueError."""
    problem = model_problem(tp, n_head=gpt.n_head, seq_len=gpt.seq_len, vocab_size=gpt.vocab_size,
                            n_kv_head=gpt.n_kv_head, ffn_hidden=gpt.ffn_hidden)
    if problem:
        raise ValueError(problem)

