"""The model shape a run trains: the config's preset and model.* keys, completed from the dataset.

The driver's preflight and the planner call this as the workers do, so all of them agree on the
shape, and on whether parallel.tp and parallel.pp can split it; it imports neither the Trainer nor
torch.distributed.
"""

from __future__ import annotations

from elastic_gpt.config import Config
from elastic_gpt.model.config import PRESETS, GPTConfig, pad_vocab
from elastic_gpt.parallel.tp_rules import model_problem


def model_config_for(cfg: Config, manifest) -> GPTConfig:
    """Preset shape, then explicit model.* keys; seq_len and vocab come from the data if unset."""
    m = cfg.model
    fields = dict(PRESETS[m.preset])
    fields.update({k: v for k, v in dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)
                   .items() if v is not None})
    fields["seq_len"] = m.seq_len or manifest.seq_len
    fields["vocab_size"] = m.vocab_size or pad_vocab(manifest.vocab_size)
    manifest.check_model(fields["vocab_size"])
    if manifest.seq_len < fields["seq_len"]:
        raise ValueError(f"dataset samples have {manifest.seq_len} tokens but model.seq_len="
                         f"{fields['seq_len']}; unset model.seq_len or re-run prepare-data with "
                         f"--seq-len {fields['seq_len']}")
    gpt = GPTConfig(**fields, dropout=m.dropout)
    check_tensor_parallel(gpt, cfg.parallel.tp)
    stages = cfg.parallel.pp * cfg.parallel.pp_stages_per_rank
    if stages > gpt.n_layer:
        raise ValueError(f"parallel.pp={cfg.parallel.pp} x parallel.pp_stages_per_rank="
                         f"{cfg.parallel.pp_stages_per_rank} stages need at least one block each, "
                         f"and the model has {gpt.n_layer}; use at most {gpt.n_layer} stages or "
                         "a deeper model (model.n_layer)")
    return gpt


def check_tensor_parallel(gpt: GPTConfig, tp: int) -> None:
    """parallel.tp splits this model (`tp_rules.model_problem`), or ValueError."""
    problem = model_problem(tp, n_head=gpt.n_head, seq_len=gpt.seq_len, vocab_size=gpt.vocab_size)
    if problem:
        raise ValueError(problem)
