"""A model family is a spec (torchtitan's model spec is the model): one `ModelSpec` per family
says everything the rest of the system needs of it, and nothing outside asks a family's name.

- the shape class, its presets and its arithmetic (parameters, FLOPs, what a block keeps for
  backward, its linears with their tensor-parallel split): model/config.py, torch-free, read by
  the planner and the cost model;
- the module (`build`), and how its trunk is cut for a pipeline: the modules of the first stage
  before the blocks (`embedding`) and of the last after them (`head`), the token embedding held
  by both when the output layer is tied to it;
- the tensor-parallel plan, as named styles per leaf (parallel/tensor.py turns the names into
  DTensor's parallel styles): `block_tp_plan` for each block, `outer_tp_plan` for the trunk;
- the FSDP units outside the blocks: a tied output layer shares the embedding's weight, so the
  trunk is one root unit kept gathered through the step; untied, the embedding and the norm with
  the output layer are units of their own (torchtitan's), gathered only while used;
- the Hugging Face layout: architecture, key names and config.json both ways
  (model/hf_layouts.py).

Imports no torch until a module is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic_gpt.model import hf_layouts
from elastic_gpt.model.config import GPTConfig, LlamaConfig, ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_type: type
    module: Callable[[], type]
    """The module class (imported when called: the spec itself imports no torch)."""
    embedding: tuple[str, ...]
    head: tuple[str, ...]
    block_tp_plan: dict[str, str]
    outer_tp_plan: dict[str, str]
    hf_architecture: str
    hf_model_type: str
    hf_name: Callable[[str], tuple[str, bool]]
    """Our parameter name -> (its key in a Hugging Face checkpoint, stored transposed)."""
    hf_base_prefix: str
    """The base model's prefix of those keys ("transformer.", "model.")."""
    hf_config: Callable[..., dict]
    """(config, eos_id, bos_id) -> the config.json of a Hugging Face export."""
    from_hf: Callable[[dict, int | None, str], ModelConfig]
    """(config.json, training seq_len or None, where) -> our config; HFLayoutError if not ours."""

    def build(self, cfg: ModelConfig):
        """The module of shape `cfg`, on the current default device ("meta" included)."""
        return self.module()(cfg)

    def tied(self, cfg: ModelConfig) -> bool:
        return bool(cfg.tie_embeddings)

    def first_stage(self, cfg: ModelConfig) -> tuple[str, ...]:
        return self.embedding

    def last_stage(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The last stage's modules after the blocks; a tied output layer needs the
        embedding's weight too."""
        return (*self.head, "wte") if self.tied(cfg) else self.head

    def fsdp_units(self, cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
        """The trunk's FSDP units besides the root (the class docstring)."""
        return () if self.tied(cfg) else (("wte",), ("ln_f", "lm_head"))


def _gpt():
    from elastic_gpt.model.gpt import GPT
    return GPT


def _llama():
    from elastic_gpt.model.llama import Llama
    return Llama


GATHERED = "gather_input"  # a branch's input all-gathered over the sequence (Shard(1) -> whole)
GPT2 = ModelSpec(
    name="gpt2", config_type=GPTConfig, module=_gpt,
    embedding=("wte", "wpe", "drop"), head=("ln_f", "lm_head"),
    block_tp_plan={"ln_1": "sequence", "attn": GATHERED, "attn.c_attn": "fused_colwise_3",
                   "attn.c_proj": "rowwise", "ln_2": "sequence", "mlp": GATHERED,
                   "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
    outer_tp_plan={"wte": "vocab_embedding", "wpe": "position_embedding", "ln_f": "sequence",
                   "lm_head": "vocab_output"},
    hf_architecture="GPT2LMHeadModel", hf_model_type="gpt2", hf_name=hf_layouts.gpt2_hf_name,
    hf_base_prefix="transformer.",
    hf_config=hf_layouts.gpt2_hf_config, from_hf=hf_layouts.gpt2_from_hf)

LLAMA = ModelSpec(
    name="llama", config_type=LlamaConfig, module=_llama,
    embedding=("wte", "drop"), head=("ln_f", "lm_head"),
    block_tp_plan={"input_layernorm": "sequence", "self_attn": GATHERED,
                   "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                   "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                   "post_attention_layernorm": "sequence", "mlp": GATHERED,
                   "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                   "mlp.down_proj": "rowwise"},
    outer_tp_plan={"wte": "vocab_embedding", "ln_f": "sequence", "lm_head": "vocab_output"},
    hf_architecture="LlamaForCausalLM", hf_model_type="llama", hf_name=hf_layouts.llama_hf_name,
    hf_base_prefix="model.",
    hf_config=hf_layouts.llama_hf_config, from_hf=hf_layouts.llama_from_hf)

FAMILIES: dict[str, ModelSpec] = {s.name: s for s in (GPT2, LLAMA)}


def spec_of(cfg: ModelConfig) -> ModelSpec:
    return FAMILIES[cfg.family]


def build_model(cfg: ModelConfig):
    """The module of `cfg`'s family and shape."""
    return spec_of(cfg).build(cfg)


def config_from_hf(hf: dict, seq_len: int | None, where: str) -> ModelConfig:
    """The model a Hugging Face config.json describes (HFLayoutError if no family builds it)."""
    return hf_layouts.config_from_hf(
        hf, {s.hf_model_type: s.from_hf for s in FAMILIES.values()}, seq_len, where)
