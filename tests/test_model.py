"""The model on its own: shapes, causality, tying, init and the FLOPs formula."""

import pytest
import torch

from elastic_gpt.model.gpt import GPT, PRESETS, GPTConfig, count_params, flops_per_token, preset_config

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
