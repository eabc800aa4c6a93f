"""The model's shape and its arithmetic, without building it: one shape class per model family
(`GPTConfig` for GPT-2, `LlamaConfig` for Llama 3), the size presets, the parameter count and
the FLOPs per token.

Imports no torch: the planner and the cost model (`elastic-gpt plan`) read a model's size from
here without paying for torch's import. Every shape class describes its block the same way (the
linears with their widths and tensor-parallel split, the norms, the embeddings, what a layer
keeps for its backward), so the arithmetic below and the cost model's are written once for every
family. model/families.py ties each shape class to its module, tensor-parallel plan, pipeline
split and Hugging Face key map.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar, NamedTuple


class Linear(NamedTuple):
    """One matmul of a block: its weight's leaf name, in and out widths, whether it has a bias,
    and how tensor parallelism splits it ("col": by output units, "row": by input units)."""

    name: str
    d_in: int
    d_out: int
    bias: bool
    split: str


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2: pre-LayerNorm with biases, learned positions, a 4x GELU MLP, tied embeddings."""

    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    """Context length (GPT-2 calls it n_positions)."""
    vocab_size: int
    """Embedding rows; usually the tokenizer's vocab padded up to a multiple of 64 for fast matmuls."""
    dropout: float = 0.0
    """0 for pretraining, as in GPT-2/3 at scale: more data beats regularisation."""

    family: ClassVar[str] = "gpt2"
    free_fields: ClassVar[tuple[str, ...]] = ()
    """Shape fields a checkpoint may differ in and still resume (no weight depends on them)."""
    tie_embeddings: ClassVar[bool] = True
    position_embedding: ClassVar[bool] = True
    """Learned positions (`wpe`, seq_len x n_embd): tensor parallelism splits them too."""

    def __post_init__(self):
        _check_heads(self)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        return self.n_head

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.n_embd

    def shape(self) -> dict:
        """The fields a checkpoint must agree on to be loadable into this model (GPT-2's
        checkpoints have always held exactly these: no family key, which reads as gpt2)."""
        return {k: v for k, v in asdict(self).items() if k != "dropout"}

    def describe(self) -> str:
        """The shape in one line, as the planner prints it."""
        return (f"L={self.n_layer} H={self.n_head} d={self.n_embd} T={self.seq_len} "
                f"V={self.vocab_size}")

    def block_linears(self) -> tuple[Linear, ...]:
        d = self.n_embd
        return (Linear("attn.c_attn", d, 3 * d, True, "col"),
                Linear("attn.c_proj", d, d, True, "row"),
                Linear("mlp.c_fc", d, 4 * d, True, "col"),
                Linear("mlp.c_proj", 4 * d, d, True, "row"))

    @property
    def block_norm_params(self) -> int:
        return 2 * 2 * self.n_embd  # ln_1, ln_2: weight + bias

    @property
    def final_norm_params(self) -> int:
        return 2 * self.n_embd

    @property
    def replicated_bias_params(self) -> int:
        """Biases tensor parallelism keeps whole on every rank: c_attn's (sliced locally, its
        gradient all-gathered) and the row-parallel c_proj's, added after the partial sums."""
        return 3 * self.n_embd + 2 * self.n_embd

    @property
    def gathered_bias_params(self) -> int:
        """c_attn's bias: replicated, its gradient holds only this rank's heads of q, k and v."""
        return 3 * self.n_embd

    norm_fp32_copies: ClassVar[int] = 0
    """fp32 copies of its input per token a block's norms keep for backward beyond the input
    itself: LayerNorm keeps its input (and a mean and a deviation per row) only."""

    @property
    def mlp_saved_width(self) -> int:
        """Widths a block's MLP keeps for backward per token: GELU's input and c_proj's."""
        return 2 * 4 * self.n_embd

    @property
    def mlp_elementwise_width(self) -> int:
        """The width of the MLP's activation (GELU), which reads and writes one such row."""
        return 4 * self.n_embd


@dataclass(frozen=True)
class LlamaConfig:
    """Llama 3: RMSNorm, rotary positions (with Llama 3.1's frequency scaling), a SwiGLU MLP,
    grouped-query attention, no biases, an untied output layer (tied as an option)."""

    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    vocab_size: int
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None: n_head (multi-head attention)."""
    ffn_hidden: int | None = None
    """The SwiGLU MLP's hidden width; None: Llama's rule from the width (`llama_ffn_hidden`)."""
    rope_theta: float = 500000.0
    rope_factor: float | None = 8.0
    """Llama 3.1's frequency scaling: low frequencies slowed by this factor, the band between
    smoothly; None: plain RoPE (Llama 3.0)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0

    family: ClassVar[str] = "llama"
    free_fields: ClassVar[tuple[str, ...]] = ("seq_len",)
    """Rotary positions have no table: a checkpoint resumes at any context length."""
    position_embedding: ClassVar[bool] = False

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", llama_ffn_hidden(self.n_embd))
        _check_heads(self)
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head={self.n_kv_head} does not divide model.n_head="
                             f"{self.n_head} (each key/value head serves a whole group of query "
                             "heads); pick a divisor of n_head")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def shape(self) -> dict:
        return {"family": self.family,
                **{k: v for k, v in asdict(self).items() if k != "dropout"}}

    def describe(self) -> str:
        rope = (f"RoPE theta {self.rope_theta:g}"
                + (f" x{self.rope_factor:g} scaled" if self.rope_factor else ""))
        return (f"Llama L={self.n_layer} H={self.n_head} kv_heads={self.n_kv_head} "
                f"d={self.n_embd} mlp={self.ffn_hidden} (SwiGLU) T={self.seq_len} "
                f"V={self.vocab_size}, {rope}, {'tied' if self.tie_embeddings else 'untied'}")

    def block_linears(self) -> tuple[Linear, ...]:
        d, kv, f = self.n_embd, self.n_kv_head * self.head_dim, self.ffn_hidden
        return (Linear("self_attn.q_proj", d, d, False, "col"),
                Linear("self_attn.k_proj", d, kv, False, "col"),
                Linear("self_attn.v_proj", d, kv, False, "col"),
                Linear("self_attn.o_proj", d, d, False, "row"),
                Linear("mlp.gate_proj", d, f, False, "col"),
                Linear("mlp.up_proj", d, f, False, "col"),
                Linear("mlp.down_proj", f, d, False, "row"))

    @property
    def block_norm_params(self) -> int:
        return 2 * self.n_embd  # input_layernorm, post_attention_layernorm: a gain each

    @property
    def final_norm_params(self) -> int:
        return self.n_embd

    norm_fp32_copies: ClassVar[int] = 2
    """RMSNorm takes its mean square in fp32 and keeps that fp32 copy of its input, and its
    normalised output in the model's dtype, for backward (model/llama.py): one fp32 row beyond
    what a LayerNorm keeps, for each of a block's two norms."""
    replicated_bias_params: ClassVar[int] = 0
    gathered_bias_params: ClassVar[int] = 0

    @property
    def mlp_saved_width(self) -> int:
        """gate_proj's and up_proj's outputs, SiLU's output and their product (down_proj's
        input), each ffn_hidden wide."""
        return 4 * self.ffn_hidden

    @property
    def mlp_elementwise_width(self) -> int:
        """SiLU on the gate and its product with the up projection: about three rows of
        ffn_hidden read and written per token where GELU moves one of 4d; counted as such."""
        return 3 * self.ffn_hidden


ModelConfig = GPTConfig | LlamaConfig
"""The shape of a model of any family."""
CONFIG_TYPES: dict[str, type] = {"gpt2": GPTConfig, "llama": LlamaConfig}


def _check_heads(cfg) -> None:
    if cfg.n_embd % cfg.n_head:
        raise ValueError(
            f"model.n_embd={cfg.n_embd} is not divisible by model.n_head={cfg.n_head}; "
            "pick a head count that divides the width"
        )


def llama_ffn_hidden(n_embd: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    """Llama's SwiGLU width: two thirds of 4 d (the parameters of a 4 d GELU MLP in three
    matrices), times `multiplier`, rounded up to a multiple of `multiple_of` (Meta's reference
    code; the published models' 14336, 28672 and 53248 come out of it)."""
    hidden = int(multiplier * int(2 * 4 * n_embd / 3))
    return multiple_of * -(-hidden // multiple_of)


# Shapes from the GPT-2 release and the GPT-3 paper (Brown et al. 2020, table 2.1). seq_len and
# vocab_size are defaults that the data manifest usually overrides.
GPT2_PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, seq_len=128),  # tests, ~0.1M non-embedding params
    "mini": dict(n_layer=4, n_head=4, n_embd=128, seq_len=256),  # the default job: minutes on 2 CPUs
    "small": dict(n_layer=6, n_head=6, n_embd=384, seq_len=256),  # nanoGPT's shakespeare-char size
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, seq_len=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280, seq_len=1024),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, seq_len=1024),
    "gpt3-1.3b": dict(n_layer=24, n_head=32, n_embd=2048, seq_len=2048),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, seq_len=2048),
    "gpt3-13b": dict(n_layer=40, n_head=40, n_embd=5120, seq_len=2048),
    "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288, seq_len=2048),
}
# The Llama 3 herd (Dubey et al. 2024, table 3; the released config.json files): 8B, 70B and
# 405B with 8 key/value heads, theta 500,000, Llama 3.1's RoPE scaling, untied; Llama 3.2's 1B
# (tied, RoPE factor 32); and small shapes that train on a CPU.
LLAMA_PRESETS: dict[str, dict] = {
    "llama3-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=128),
    "llama3-mini": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, seq_len=256),
    "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192,
                        seq_len=8192, rope_factor=32.0, tie_embeddings=True),
    "llama3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                      seq_len=8192),
    "llama3-70b": dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, ffn_hidden=28672,
                       seq_len=8192),
    "llama3-405b": dict(n_layer=126, n_head=128, n_kv_head=8, n_embd=16384, ffn_hidden=53248,
                        seq_len=8192),
}
PRESET_FAMILY: dict[str, str] = {**dict.fromkeys(GPT2_PRESETS, "gpt2"),
                                 **dict.fromkeys(LLAMA_PRESETS, "llama")}
PRESETS: dict[str, dict] = {**GPT2_PRESETS, **LLAMA_PRESETS}
GPT2_VOCAB = 50257
LLAMA3_VOCAB = 128256
DEFAULT_VOCAB = {"gpt2": GPT2_VOCAB, "llama": LLAMA3_VOCAB}

# The fp32 work of the loss (the upcast logits, their log-softmax and softmax) runs on chunks of
# at most this many logits (64 MiB in fp32), whatever the batch: the whole fp32 logits of a
# (16 x 1024)-token micro-batch over GPT-2's vocabulary are 3.3 GB, and their gradient as much.
# model/gpt.py's loss (`chunked_token_losses`) runs so; the memory model counts it.
LOSS_CHUNK_LOGITS = 1 << 24


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """50257 -> 50304: a multiple of 64 keeps the lm_head matmul on fast kernel paths."""
    return -(-vocab_size // multiple) * multiple


def make_config(family: str, fields_: dict) -> ModelConfig:
    """The shape class of `family` from `fields_`, keeping only the fields it has: a GPT-2
    preset's sizes build a Llama of those sizes, the Llama-only fields at Llama's defaults."""
    if family not in CONFIG_TYPES:
        raise ValueError(f"model.family={family!r} is unknown; choose one of "
                         f"{', '.join(CONFIG_TYPES)}")
    cls = CONFIG_TYPES[family]
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in fields_.items() if k in known})


def preset_config(name: str, family: str | None = None, **overrides) -> ModelConfig:
    """Preset `name` (of `family`, default: the preset's own) with `overrides` (None: unset)."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; choose one of {', '.join(PRESETS)}")
    family = family or PRESET_FAMILY[name]
    fields_ = dict(PRESETS[name], vocab_size=pad_vocab(DEFAULT_VOCAB[family]))
    fields_.update({k: v for k, v in overrides.items() if v is not None})
    return make_config(family, fields_)


def config_from_shape(shape: dict, dropout: float = 0.0) -> ModelConfig:
    """The config a checkpoint's `model_shape` describes (no family key: GPT-2, whose
    checkpoints were the only ones before families)."""
    fields_ = dict(shape)
    family = fields_.pop("family", "gpt2")
    return make_config(family, {**fields_, "dropout": dropout})


def count_params(cfg: ModelConfig) -> dict:
    """Parameter count by arithmetic, without building the model (used by the planner too).
    "embedding": the lookup tables (tokens, and GPT-2's positions); an untied output layer is a
    matmul, counted with the rest."""
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    per_block = cfg.block_norm_params + sum(
        lin.d_in * lin.d_out + (lin.d_out if lin.bias else 0) for lin in cfg.block_linears())
    embeddings = V * d + (cfg.seq_len * d if cfg.position_embedding else 0)
    head = 0 if cfg.tie_embeddings else V * d
    total = embeddings + L * per_block + cfg.final_norm_params + head
    return {"total": total, "embedding": embeddings, "non_embedding": total - embeddings}


def block_matmul_params(cfg: ModelConfig) -> int:
    """The weights of one block's matmuls: each multiplies every token once."""
    return sum(lin.d_in * lin.d_out for lin in cfg.block_linears())


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token: forward + backward = 3x forward, 2 FLOPs per multiply-add.

    Counts every matmul: per layer its weights' MACs (GPT-2: qkv 3d^2, proj d^2, mlp 8d^2; Llama:
    q and o d^2 each, k and v d x kv width, the SwiGLU's three d x ffn_hidden) plus attention's
    two T*d products (QK^T and AV, counted over the full T as PaLM and nanoGPT do), and the
    output layer's V*d (tied or not). This is the `6N + 12*L*d*T` of the PaLM paper's MFU
    appendix, with N the matmul parameters; embedding lookups and norms are not FLOPs that
    matter.
    """
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    matmul_params = L * block_matmul_params(cfg) + V * d
    return 6 * matmul_params + 12 * L * d * T
