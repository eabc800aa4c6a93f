"""GPT-2 style decoder in one readable file (nanoGPT lineage), and what every family's decoder
shares (`Decoder`: the trunk's names, the seeded initialisation, the tied output layer, the
chunked loss; model/llama.py is the other family).

Parameter names follow GPT-2 (`wte`, `wpe`, `h.N.attn.c_attn`, ...) so checkpoints map one to one
onto Hugging Face's `GPT2LMHeadModel` (see `inference/hf_export.py`). Nothing here knows about Ray or FSDP.
The shape it is built from (`GPTConfig`), the presets and the parameter and FLOP counts are
model/config.py's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The model's shape and its arithmetic live in model/config.py, which imports no torch (the
# planner reads them there).
from elastic_gpt.model.config import LOSS_CHUNK_LOGITS, GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # c_attn's output is [q | k | v]. Under tensor parallelism it holds only this rank's heads
        # of each (parallel/tensor.py), so the head count is read from the width, not the config.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, nh * hs) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # SDPA picks flash / memory-efficient kernels on GPU and a fused math path on CPU.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, nh, T, hs) -> (B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 used the tanh approximation of GELU; matching it keeps HF logits identical.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-LayerNorm residual blocks
        return x + self.mlp(self.ln_2(x))


class TiedLMHead(nn.Linear):
    """The output projection, tied to the token embedding (GPT-2): its weight IS `wte.weight`.

    A Linear, so tensor parallelism can give it a plan of its own (vocab-parallel logits), but it
    registers no parameter: parameters, state dict and checkpoints hold `wte.weight` once, as
    GPT-2's do. The weight is read from the embedding at every call, so whatever wte holds then
    (a DTensor under tensor parallelism, FSDP's gathered weight during a step) is what it uses.
    """

    def __init__(self, wte: nn.Embedding):
        nn.Module.__init__(self)
        self.in_features, self.out_features = wte.embedding_dim, wte.num_embeddings
        self.register_parameter("bias", None)
        # A plain attribute, not a submodule: wte stays registered once, under GPT.
        self.__dict__["_wte"] = wte

    @property
    def weight(self) -> torch.Tensor:
        return self._wte.weight


class Decoder(nn.Module):
    """A decoder of any family, as the rest of the system holds it: token embedding `wte`, the
    blocks `h`, the final norm `ln_f` and the output layer `lm_head` (its own weight, or tied to
    `wte`). A family's module sets `residual_projections`, builds them and says how tokens
    become the first hidden states (`embed`). Initialisation: N(0, 0.02) for every weight
    matrix, the residual projections (the last matmul of each residual branch) scaled by
    1/sqrt(2 * n_layer) (GPT-2's rule), zero biases, unit norm gains."""

    residual_projections: tuple[str, ...] = ()

    def init_weights(self, seed: int = 0) -> None:
        with torch.no_grad():
            for name, value in self.initial_values(seed):
                self.get_parameter(name).copy_(value)

    def parameter_index(self, name: str) -> int:
        """The parameter's position in this model's parameters: what its initial value is drawn
        from (a pipeline stage answers with the whole model's position)."""
        if not hasattr(self, "_parameter_index"):
            self.__dict__["_parameter_index"] = {
                plain_name(n): i for i, (n, _) in enumerate(self.named_parameters())}
        return self._parameter_index[plain_name(name)]

    def initial_values(self, seed: int):
        """(name, full tensor) per parameter, in parameter order (`initial_value`)."""
        for index, (name, p) in enumerate(self.named_parameters()):
            yield name, self.initial_value(index, name, p.shape, seed)

    def initial_value(self, index: int, name: str, shape: torch.Size, seed: int,
                      indices: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Parameter number `index` (`name`, of full `shape`) as initialised (the class
        docstring's rule). `indices`: one tensor of global indices per dim (a shard, in its
        order); None: whole.

        A weight matrix is drawn on the CPU in tiles (`init_tiles`), each from its own seeded
        generator, so a rank holding one shard draws only the tiles its shard covers, and the
        values are the same on any device and at any world size and layout."""
        indices = indices if indices is not None else [torch.arange(n) for n in shape]
        size = [len(i) for i in indices]
        if name.endswith(".weight") and len(shape) == 2:  # Linear and Embedding
            std = (0.02 / math.sqrt(2 * self.cfg.n_layer)
                   if plain_name(name).endswith(self.residual_projections) else 0.02)
            return init_tiles(seed, index, tuple(shape), indices[0], indices[1], std)
        if name.endswith(".bias"):
            return torch.zeros(size)
        return torch.ones(size)  # a norm's gain

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the first hidden states (B, T, C)."""
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size). With targets (B, T): the summed
        cross-entropy of every token instead, computed chunk by chunk from the last hidden
        states (`chunked_token_losses`), so the (B, T, vocab) logits never exist whole."""
        T = idx.size(1)
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)  # (B, T, vocab)
        return chunked_token_losses(x, self.lm_head.weight, targets)


class GPT(Decoder):
    residual_projections = ("attn.c_proj.weight", "mlp.c_proj.weight")

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = TiedLMHead(self.wte)
        if not self.wte.weight.is_meta:  # on "meta" the trainer inits after sharding instead
            self.init_weights()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() - self.wte.weight.numel() if non_embedding else n


INIT_TILE = (256, 4096)
"""Rows x columns of a weight matrix drawn from one generator. A rank draws whole tiles, so a
shard's init costs its own size plus at most the tiles its edges cut (not the full matrix)."""


def init_tiles(seed: int, index: int, shape: tuple[int, int], rows: torch.Tensor,
               cols: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std) values of matrix number `index` at `rows` x `cols` (global indices, any order).
    Element (i, j) is drawn by the generator of tile (i // R, j // C), seeded from (seed, index,
    tile), whoever asks for it."""
    tr, tc = INIT_TILE
    out = torch.empty(len(rows), len(cols))
    col_parts = _tile_parts(cols, tc)
    gen = torch.Generator()
    for ti, r_out, r_in in _tile_parts(rows, tr):
        for tj, c_out, c_in in col_parts:
            gen.manual_seed(_tile_seed(seed, index, ti, tj))
            tile = torch.empty(min(tr, shape[0] - ti * tr), min(tc, shape[1] - tj * tc))
            tile.normal_(0.0, std, generator=gen)
            if all(isinstance(i, slice) for i in (r_out, c_out, r_in, c_in)):
                out[r_out, c_out] = tile[r_in, c_in]  # the usual case: a block, copied whole
            else:  # a strided shard's rows: gathered and scattered element-wise
                r_out, c_out, r_in, c_in = map(_as_index, (r_out, c_out, r_in, c_in))
                out[r_out[:, None], c_out[None, :]] = tile[r_in[:, None], c_in[None, :]]
    return out


def _tile_parts(indices: torch.Tensor, size: int) -> list[tuple]:
    """Per tile of `size` that `indices` touch: (tile, positions in `indices`, offsets in the
    tile), each a slice when it is a run of consecutive numbers."""
    tiles = indices // size
    parts = []
    for t in tiles.unique().tolist():
        where = (tiles == t).nonzero().squeeze(1)
        parts.append((t, _as_run(where), _as_run(indices[where] - t * size)))
    return parts


def _as_run(idx: torch.Tensor) -> slice | torch.Tensor:
    if len(idx) == 1 or bool((idx[1:] - idx[:-1] == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _as_index(part: slice | torch.Tensor) -> torch.Tensor:
    return torch.arange(part.start, part.stop) if isinstance(part, slice) else part


def _tile_seed(seed: int, index: int, ti: int, tj: int) -> int:
    """A 63-bit seed per tile: splitmix64's finaliser over the four numbers, so neighbouring tiles
    and parameters get unrelated streams."""
    x = 0
    for part in (seed, index, ti, tj):
        x = (x ^ (part & 0xFFFF_FFFF_FFFF_FFFF)) * 0x9E37_79B9_7F4A_7C15 & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 30
        x = x * 0xBF58_476D_1CE4_E5B9 & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 27
        x = x * 0x94D0_49BB_1331_11EB & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 31
    return x & 0x7FFF_FFFF_FFFF_FFFF


def plain_name(name: str) -> str:
    """A parameter's name without the levels activation checkpointing's and compile's wrappers
    add: its name in the unwrapped model."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every token (callers weight by the global token count: C1 fixed
    global batch), from whole logits: what tensor parallelism's vocab-sharded logits need.
    Without it, `GPT.forward(idx, targets)` gives the same sum without the whole logits."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
    )


LOSS_SCOPE = "elastic_gpt::loss"
"""The profiler's name for the loss's own work, forward and backward (bench/gpu_profile.py)."""


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """`token_losses(hidden @ weight.T, targets)` without an fp32 copy of the whole logits: the
    output layer's matmul writes the logits in the compute dtype (autocast's, as the Linear
    would), and the upcast and log-softmax run in fp32 on `chunk_tokens` tokens at a time
    (default: LOSS_CHUNK_LOGITS logits per chunk), the loss summed in fp32.

    With gradients enabled each chunk's softmax-minus-one-hot, the gradient of the logits, is
    written over its logits in the compute dtype, so what the backward keeps is that one
    (tokens x vocab) tensor: 2 bytes an element in bf16 (4 in fp32) where the whole-logits loss
    keeps 12 (the fp32 log-softmax, and in the backward two fp32 gradients). The backward is
    the output layer's two matmuls over all tokens at once, as before (no recompute, no
    per-chunk sum of the weight's gradient), and the gradient is rounded to the compute dtype
    where it was before. Not for vocab-sharded (tensor-parallel) weights: those take
    `token_losses` under loss_parallel.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        raise TypeError("chunked_token_losses needs whole (not tensor-parallel) output weights; "
                        "compute vocab-sharded logits' loss with token_losses under loss_parallel")
    device = hidden.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else torch.promote_types(hidden.dtype, weight.dtype))
    chunk = chunk_tokens or max(1, LOSS_CHUNK_LOGITS // weight.size(0))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, dtype, chunk)
    with torch.autocast(device, enabled=False):
        return _cross_entropy_by_chunks(hidden.reshape(-1, hidden.size(-1)).to(dtype),
                                        weight.to(dtype), targets, chunk, keep_gradient=False)[0]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The summed loss; the forward leaves the logits' gradient for the backward's matmuls."""

    @staticmethod
    @torch.profiler.record_function(LOSS_SCOPE)
    def forward(ctx, hidden, weight, targets, dtype, chunk):
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit
            h, w = hidden.reshape(-1, hidden.size(-1)).to(dtype), weight.to(dtype)
            loss, grad_logits = _cross_entropy_by_chunks(h, w, targets, chunk,
                                                         keep_gradient=True)
        ctx.save_for_backward(grad_logits, h, w)
        ctx.shapes = hidden.shape, hidden.dtype, weight.dtype
        return loss

    @staticmethod
    @torch.profiler.record_function(LOSS_SCOPE)
    def backward(ctx, grad_loss):
        grad_logits, h, w = ctx.saved_tensors
        shape, hidden_dtype, weight_dtype = ctx.shapes
        grad_hidden = grad_weight = None
        # The incoming gradient (a scalar) scales the (tokens x width) operand or result, not the
        # (tokens x vocab) gradient: each matmul's inputs and output are rounded once to the
        # compute dtype, as the whole-logits backward's are.
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits @ w).float().mul_(grad_loss).to(hidden_dtype).view(shape)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits.t() @ (h * grad_loss).to(h.dtype)).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def _cross_entropy_by_chunks(h, w, targets, chunk, keep_gradient):
    """(summed loss, d loss/d logits or None) of the logits h @ w.T, both in the compute dtype;
    `keep_gradient`: write the logits, then their gradient, into one (tokens x vocab) tensor."""
    t = targets.reshape(-1, 1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad = h.new_empty(h.size(0), w.size(0)) if keep_gradient else None
    for start in range(0, h.size(0), chunk):
        end = min(start + chunk, h.size(0))
        logits = torch.mm(h[start:end], w.t(), out=grad[start:end] if keep_gradient else None)
        upcast = logits.float()  # this chunk's only; the same tensor in fp32
        lse = torch.logsumexp(upcast, dim=1, keepdim=True)
        loss += (lse - upcast.gather(1, t[start:end])).sum()
        if keep_gradient:
            # d(summed loss)/d(logits) = softmax - one_hot(target), made in place of the logits.
            probs = upcast.sub_(lse).exp_()
            probs.scatter_add_(1, t[start:end], torch.full_like(lse, -1.0))
            if probs.data_ptr() != logits.data_ptr():
                logits.copy_(probs)
    return loss, grad
