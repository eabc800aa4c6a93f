"""The model on its own: shapes, causality, tying, init, the FLOPs formula, and the loss computed
chunk by chunk (the same loss and gradients as from whole logits, without ever holding them)."""

import copy

import pytest
import torch

from elastic_gpt.model import gpt
from elastic_gpt.model.config import (
    PRESETS,
    GPTConfig,
    count_params,
    flops_per_token,
    preset_config,
)
from elastic_gpt.model.gpt import GPT, token_losses
from elastic_gpt.torch_internals import TorchDispatchMode

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64)


def test_logits_shape_and_gpt2_parameter_names():
    model = GPT(CFG)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    names = set(dict(model.named_parameters()))
    for expected in ["wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
                     "h.0.attn.c_proj.bias", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight",
                     "ln_f.bias"]:
        assert expected in names
    assert not any(n.startswith("lm_head") for n in names)  # tied to wte
    # The state dict (what checkpoints and export-hf hold) is the parameters, once each.
    assert list(model.state_dict()) == list(dict(model.named_parameters()))
    assert model.lm_head.weight is model.wte.weight


def test_future_tokens_do_not_change_past_logits():
    model = GPT(CFG).eval()
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 64  # change only positions >= 10
    a, b = model(x), model(y)
    torch.testing.assert_close(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_output_projection_is_tied_to_the_embedding():
    model = GPT(CFG).eval()
    x = torch.randint(6, 64, (2, 8))  # token 5 never appears in the input
    before = model(x)
    with torch.no_grad():
        model.wte.weight[5] += 1.0
    after = model(x)
    # Only the logit of token 5 moves: the output projection is the embedding matrix itself.
    assert not torch.allclose(before[..., 5], after[..., 5])
    torch.testing.assert_close(before[..., 6:], after[..., 6:])
    assert count_params(CFG)["total"] == sum(p.numel() for p in model.parameters())


def test_init_is_seeded_and_gpt2_scaled():
    a, b = GPT(CFG), GPT(CFG)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    big = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, seq_len=8, vocab_size=64))
    std_proj = big.h[0].mlp.c_proj.weight.std().item()
    assert abs(std_proj - 0.02 / (2 * 8) ** 0.5) < 0.001
    assert abs(big.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001


def test_flops_per_token_matches_a_hand_count():
    # Hand count for the tiny config: d=32, L=2, V=64, T=16, multiply-adds per token forward:
    d, L, V, T = 32, 2, 64, 16
    qkv, proj, fc, fc2 = d * 3 * d, d * d, d * 4 * d, 4 * d * d
    attn_scores, attn_values = T * d, T * d
    per_layer = qkv + proj + fc + fc2 + attn_scores + attn_values
    forward_macs = L * per_layer + V * d  # + tied lm_head
    assert flops_per_token(CFG) == 3 * 2 * forward_macs  # fwd + 2x bwd, 2 FLOPs per MAC


def test_presets_cover_gpt2_and_gpt3_shapes():
    assert count_params(preset_config("gpt2-124m"))["total"] == pytest.approx(124.4e6, rel=0.01)
    assert count_params(preset_config("gpt2-1.5b"))["total"] == pytest.approx(1.56e9, rel=0.01)
    assert count_params(preset_config("gpt3-175b"))["total"] == pytest.approx(175e9, rel=0.02)
    assert {"tiny", "gpt2-350m", "gpt2-774m", "gpt3-6.7b", "gpt3-13b"} <= set(PRESETS)


def test_bad_shape_names_the_fields():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by model.n_head=4"):
        GPTConfig(n_layer=1, n_head=4, n_embd=30, seq_len=8, vocab_size=8)
    with pytest.raises(ValueError, match="model.preset='gpt5'"):
        preset_config("gpt5")


# 3 x 16 = 48 tokens over a vocabulary of 64; chunks of 7 tokens: 7 chunks, the last one short.
LOSS_CHUNK = 7


def _loss_and_grads(model: GPT, x, y, dtype: torch.dtype, chunked: bool, scale: float):
    """The summed loss and every parameter's gradient of (loss * scale), under autocast in
    `dtype` as the trainer runs it: from whole logits (`token_losses`), or chunked."""
    model = copy.deepcopy(model)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(x, targets=y) if chunked else model(x)
    loss = out if chunked else token_losses(out, y)
    (loss * scale).backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_gives_the_loss_and_gradients_of_whole_logits(dtype, device, monkeypatch):
    """Every gradient, the tied embedding/output weight's included, and the loss; in fp32 to
    float rounding; in bf16 within bf16's rounding of the fp32 figures (torch's bf16 rtol, on
    each gradient's norm), as the whole-logits path is: the bf16 roundings differ (the chunks'
    logit gradients are rounded before the incoming gradient scales them, the tied weight's
    gradient is summed in fp32). The scale is the trainer's kind, 1/(G*T), not a power of 2."""
    monkeypatch.setattr(gpt, "LOSS_CHUNK_LOGITS", LOSS_CHUNK * CFG.vocab_size)
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    x, y = (torch.randint(0, 64, (3, 16), device=device) for _ in range(2))
    scale = 1 / (12 * 16)
    whole_loss, whole = _loss_and_grads(model, x, y, dtype, chunked=False, scale=scale)
    loss, grads = _loss_and_grads(model, x, y, dtype, chunked=True, scale=scale)
    assert loss.dtype == whole_loss.dtype == torch.float32
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == whole.keys() and "wte.weight" in grads
    if dtype == torch.float32:
        for name, g in whole.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    else:
        _, exact = _loss_and_grads(model, x, y, torch.float32, chunked=False, scale=scale)
        for name, g in exact.items():
            for path in (grads, whole):
                assert 0 < (path[name] - g).norm() / g.norm() < 1.6e-2, name
    # Without gradients (evaluation) the same loss.
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        assert torch.equal(model(x, targets=y), loss)


class _LargestOutputs(TorchDispatchMode):
    """The element count of the largest tensor any operation made, by dtype."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


def test_chunked_loss_never_holds_fp32_logits(monkeypatch):
    """Under bf16 autocast no operation of the forward or backward makes an fp32 tensor as
    large as the (B, T, vocab) logits (the whole-logits loss makes several, and the detector sees
    them); the one tensor of that size is the logits' bf16 gradient. A vocabulary large against
    the width, as GPT-2's is, so that the logits are the largest activation."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=512)
    monkeypatch.setattr(gpt, "LOSS_CHUNK_LOGITS", LOSS_CHUNK * cfg.vocab_size)
    model = GPT(cfg)
    x, y = torch.randint(0, 512, (4, 16)), torch.randint(0, 512, (4, 16))
    whole_logits = x.numel() * cfg.vocab_size
    largest = {}
    for chunked in (False, True):
        with _LargestOutputs() as seen:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, targets=y) if chunked else model(x)
            (out if chunked else token_losses(out, y)).backward()
        largest[chunked] = seen.largest
    assert largest[False][torch.float32] == whole_logits
    # The largest fp32 tensors left: a chunk of logits, or the output weight's gradient
    # (vocab x width, a quarter of the logits here).
    assert largest[True][torch.float32] == max(LOSS_CHUNK * cfg.vocab_size,
                                               cfg.vocab_size * cfg.n_embd) < whole_logits
    assert largest[True][torch.bfloat16] == whole_logits
