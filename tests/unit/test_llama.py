"""The Llama 3 family on its own, in one process: the published shapes' parameter and FLOP
counts, the kv-head tensor-parallel rule's one line, a meta build materialised and initialised
as the trainer does it equal to an eager build (logits included: the rotary tables are no
buffer), the parts that make it Llama (grouped-query attention, Llama 3.1's frequency scaling,
tied or untied output), and Hugging Face config.json read in transformers 4's and 5's layouts.
Equality with transformers' own LlamaForCausalLM is tests/integration/test_hf_checkpoints.py's."""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.model.config import (
    PRESETS,
    LlamaConfig,
    config_from_shape,
    count_params,
    flops_per_token,
    make_config,
    preset_config,
)
from elastic_gpt.model.families import FAMILIES, build_model, config_from_hf
from elastic_gpt.model.hf_layouts import HFLayoutError
from elastic_gpt.model.llama import Llama, rope_frequencies
from elastic_gpt.parallel.tp_rules import model_problem
from elastic_gpt.train.model_config import check_tensor_parallel

CFG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=16, vocab_size=64,
                  ffn_hidden=48, rope_original_seq_len=8)


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.030), ("llama3-70b", 70.554),
                                           ("llama3-405b", 405.853), ("llama3.2-1b", 1.236)])
def test_presets_have_the_published_parameter_counts(name, billions):
    cfg = preset_config(name)
    assert cfg.vocab_size == 128256 and cfg.rope_theta == 500000.0 and cfg.n_kv_head == 8
    assert round(count_params(cfg)["total"] / 1e9, 3) == billions


def test_the_flop_count_is_the_published_training_compute():
    """Llama 3's 405B took 3.8e25 FLOPs on 15.6T tokens (Dubey et al. 2024, sec. 3.2.1): 6 FLOPs
    per matmul weight per token; this count adds attention's 12 L d T on top."""
    cfg = preset_config("llama3-405b")
    d, L, T = cfg.n_embd, cfg.n_layer, cfg.seq_len
    attention = 12 * L * d * T
    matmuls = count_params(cfg)["total"] - cfg.vocab_size * d - (2 * L + 1) * d  # not lookups, norms
    assert flops_per_token(cfg) == 6 * matmuls + attention
    assert (flops_per_token(cfg) - attention) * 15.6e12 == pytest.approx(3.8e25, rel=0.01)


def test_a_small_llama_counts_what_it_builds():
    for cfg in (CFG, make_config("llama", {**CFG.shape(), "tie_embeddings": True})):
        model = Llama(cfg)
        assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert set(PRESETS) >= {"llama3-tiny", "llama3-mini", "llama3-8b", "llama3-70b", "llama3-405b"}


def test_tp_must_divide_the_kv_heads_in_one_line_naming_the_key():
    one_kv = make_config("llama", {**CFG.shape(), "n_kv_head": 1})
    with pytest.raises(ValueError) as e:
        check_tensor_parallel(one_kv, 2)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("parallel.tp=2 does not divide model.n_kv_head=1 (each tensor-parallel "
                           "rank needs whole key/value heads")
    assert "use parallel.tp in {1}" in line
    odd = make_config("llama", {**CFG.shape(), "ffn_hidden": 51})
    assert "model.ffn_hidden=50" in model_problem(4, n_head=4, seq_len=16, n_kv_head=4,
                                                  ffn_hidden=50)
    check_tensor_parallel(CFG, 2)  # 4 heads, 2 kv heads, 48 hidden units: tp=2 splits them
    with pytest.raises(ValueError, match="model.ffn_hidden=51"):
        check_tensor_parallel(odd, 2)


def test_a_meta_build_materialised_and_initialised_is_the_eager_build():
    eager = Llama(CFG)
    eager.init_weights(seed=5)
    with torch.device("meta"):
        meta = build_model(CFG)
    meta.to_empty(device="cpu")  # garbage everywhere, as the trainer's shards start
    meta.init_weights(seed=5)
    for (n, p), (_, q) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q), n
    assert not list(meta.buffers())  # nothing that to_empty would leave as garbage
    with torch.device("meta"):  # and a model that stays on "meta" runs (shapes only)
        on_meta = build_model(CFG)
        idx = torch.zeros(2, CFG.seq_len, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert on_meta(idx).shape == (2, CFG.seq_len, CFG.vocab_size)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert torch.equal(eager.eval()(x), meta.eval()(x))


def test_rope_scaling_changes_only_the_low_frequencies():
    standard = make_config("llama", {**CFG.shape(), "n_embd": 512, "rope_original_seq_len": 8192})
    plain = rope_frequencies(make_config("llama", {**standard.shape(), "rope_factor": None}))
    scaled = rope_frequencies(standard)
    assert torch.equal(scaled[0], plain[0])  # the highest frequency is left alone
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)  # the lowest slowed 8 times
    assert not torch.equal(scaled, plain)
    model = Llama(CFG).eval()
    unscaled = Llama(make_config("llama", {**CFG.shape(), "rope_factor": None})).eval()
    unscaled.load_state_dict(model.state_dict())
    x = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len))
    assert not torch.allclose(model(x), unscaled(x), atol=1e-4)


def test_grouped_query_attention_and_the_output_layer():
    model = Llama(CFG)
    attn = model.h[0].self_attn
    assert attn.k_proj.weight.shape == (CFG.n_kv_head * CFG.head_dim, CFG.n_embd)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert "lm_head.weight" in dict(model.named_parameters())
    tied = Llama(make_config("llama", {**CFG.shape(), "tie_embeddings": True}))
    assert tied.lm_head.weight is tied.wte.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    # the residual projections start scaled down, as GPT-2's
    big = Llama(LlamaConfig(n_layer=8, n_head=4, n_embd=256, seq_len=8, vocab_size=64))
    assert big.h[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 4, abs=1e-3)
    assert big.h[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, abs=1e-3)


def test_model_dropout_reaches_the_embeddings_as_gpt2s():
    model = Llama(make_config("llama", {**CFG.shape(), "dropout": 0.5}))
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    looked_up = model.wte(x)
    torch.manual_seed(0)
    dropped = model.train().embed(x)
    kept = dropped != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(dropped[kept], 2 * looked_up[kept])
    torch.testing.assert_close(model.eval().embed(x), looked_up)
    assert "drop" in FAMILIES["llama"].first_stage(CFG)  # a pipeline's first stage drops too


def test_a_checkpoint_shape_reads_back_into_its_family():
    assert config_from_shape(CFG.shape()) == CFG
    gpt = preset_config("tiny")
    assert config_from_shape(gpt.shape()) == gpt  # no family key: GPT-2's


def test_model_family_switches_a_preset_to_llama(tmp_path):
    from elastic_gpt.train.model_config import model_config_for

    class Manifest:
        seq_len, vocab_size = 128, 257

        def check_model(self, vocab_size):
            pass

    cfg = load_config(None, ["data.path=unused", "model.family=llama"])
    llama = model_config_for(cfg, Manifest())
    assert llama.family == "llama" and (llama.n_layer, llama.n_embd) == (2, 64)
    assert llama.ffn_hidden == 256 and llama.vocab_size == 320
    with pytest.raises(ValueError, match="model.n_kv_head is not a setting of the gpt2 family"):
        load_config(None, ["data.path=unused", "model.n_kv_head=2"])


LLAMA_HF = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 16}
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}


def test_config_json_in_transformers_4_and_5_layouts_is_the_same_model():
    v4 = {**LLAMA_HF, "rope_theta": 500000.0, "rope_scaling": SCALING}
    v5 = {**LLAMA_HF, "rope_parameters": {**SCALING, "rope_theta": 500000.0}}
    assert config_from_hf(v4, None, "v4") == config_from_hf(v5, None, "v5") == CFG
    old_key = {**v4, "rope_scaling": {**{k: v for k, v in SCALING.items() if k != "rope_type"},
                                      "type": "llama3"}}
    assert config_from_hf(old_key, None, "old") == CFG
    plain = config_from_hf({**LLAMA_HF, "rope_theta": 500000.0}, None, "plain")
    assert plain.rope_factor is None
    # what export writes reads back
    assert config_from_hf(FAMILIES["llama"].hf_config(CFG, 1), 16, "export") == CFG


@pytest.mark.parametrize("change,words", [
    ({"model_type": "mistral"}, "model_type='mistral' is not one this trainer builds"),
    ({"attention_bias": True}, "attention_bias=true, and Llama has no biases"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
])
def test_a_config_json_this_trainer_cannot_build_is_one_line(change, words):
    with pytest.raises(HFLayoutError) as e:
        config_from_hf({**LLAMA_HF, "rope_theta": 500000.0, **change}, None, "DIR/config.json")
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("DIR/config.json: ")


def test_the_planner_counts_a_llama_block(monkeypatch):
    """plan --model llama3-70b: its kv heads and MLP width in the report, and this block's
    arithmetic: no learned positions to split or gather, two norm gains per block (their
    gradients all-reduced per sync), no fused bias, the untied output layer in the root."""
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.cost_model.tensor_parallel import tp_traffic
    from elastic_gpt.planner.inputs import PlanInputs
    from elastic_gpt.planner.report import format_report
    from elastic_gpt.planner.training_plan import plan_training

    plan = plan_training(PlanInputs(model="llama3-70b", gpu="H100", n_gpus=64, tp=8, pp=1,
                                    hsdp="off", replica_groups="off"))
    line = format_report(plan).splitlines()[0]
    assert "70,553.7M params" in line and "kv_heads=8" in line and "mlp=28672" in line
    cfg = preset_config("llama3-70b")
    shape = model_shape(cfg)
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    assert shape.block_replicated_params == 2 * d and shape.block_fused_bias_params == 0
    assert shape.root_params == 2 * V * d + d and shape.embedding_params == V * d
    traffic = tp_traffic(shape, 1, 8, activation_checkpointing=False, act_bytes=2, grad_bytes=4)
    assert (traffic.all_gathers, traffic.reduce_scatters) == (4 * L + 2, 4 * L + 2)
    assert traffic.sync_collectives == 2 * L + 1
    gpt = model_shape(preset_config("gpt3-175b"))  # GPT-2's: positions, LayerNorm biases, c_attn
    gpt_traffic = tp_traffic(gpt, 1, 8, activation_checkpointing=False, act_bytes=2,
                             grad_bytes=4)
    assert gpt_traffic.all_gathers == 4 * gpt.cfg.n_layer + 3
    assert gpt_traffic.sync_collectives == 5 * gpt.cfg.n_layer + 2


def test_init_from_refuses_a_dataset_of_another_tokenizer(tmp_path):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from elastic_gpt.train.model_config import model_config_for

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_HF, "vocab_size": 320}))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)} | {"</s>": 300},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))

    class Manifest:
        url, tokenizer, seq_len = "data/bytes", "bytes", 16

        def __init__(self, vocab_size):
            self.vocab_size = vocab_size

    cfg = load_config(None, ["data.path=unused", f"checkpoint.init_from={tmp_path}"])
    with pytest.raises(ValueError, match=r"was tokenized with 'bytes' \(257 ids\), not "
                                         r"checkpoint.init_from's tokenizer \(301 ids\)"):
        model_config_for(cfg, Manifest(257))
    with pytest.raises(ValueError, match="a vocabulary of 400 ids"):
        model_config_for(cfg, Manifest(400))
    llama = model_config_for(cfg, Manifest(301))  # the directory's own tokenizer
    assert (llama.family, llama.vocab_size, llama.seq_len, llama.n_kv_head) == ("llama", 320, 16, 2)
    bad = load_config(None, ["data.path=unused", f"checkpoint.init_from={tmp_path}",
                             "model.n_layer=3"])
    with pytest.raises(ValueError, match="model.n_layer=3 disagrees with checkpoint.init_from"):
        model_config_for(bad, Manifest(301))


def test_a_shard_reads_only_its_own_slices_of_a_safetensors_weight(tmp_path):
    """What `checkpoint.init_from` relies on for a model larger than a host: a rank's shard of
    a weight (here rows of three parts, as tensor parallelism's fused q|k|v shard is, stored
    transposed as GPT-2's Conv1D) is read as those runs alone, never the whole tensor."""
    from safetensors.torch import save_file

    from elastic_gpt.checkpoint.hf_weights import HFWeights

    full = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)  # ours: (out 12, in 6)
    save_file({"w": full.t().contiguous()}, str(tmp_path / "model.safetensors"))
    weights = HFWeights(str(tmp_path))
    read = []
    handle = weights._handle("model.safetensors")

    class Recording:
        def get_slice(self, name):
            part = handle.get_slice(name)

            class Slice:
                def __getitem__(self, index):
                    out = part[index]
                    read.append(out.numel())
                    return out
            return Slice()

    weights._open["model.safetensors"] = Recording()
    rows = torch.tensor([2, 3, 6, 7, 10, 11])  # rank 1 of 2: its half of each of 3 parts
    cols = torch.arange(6)
    got = weights.read("w", [rows, cols], transposed=True)
    assert torch.equal(got, full[rows])
    assert read == [12, 12, 12]  # three runs of 2 rows x 6 columns: the shard's 36 elements


def test_rope_parameters_without_a_type_or_per_layer_type():
    v5 = {**LLAMA_HF, "rope_parameters": {"rope_theta": 10000.0}}
    assert config_from_hf(v5, None, "v5").rope_factor is None
    per_type = {**LLAMA_HF, "rope_parameters": {"full_attention": {**SCALING,
                                                                   "rope_theta": 500000.0}}}
    assert config_from_hf(per_type, None, "per-type") == CFG


def test_a_dry_run_of_a_config_plans_the_model_the_trainer_builds(tmp_path):
    """`dry-run --config` of a GPT-2 preset switched to Llama by model.family (with a kv-head
    key): the planner it is compared with counts the same Llama, not the preset's GPT-2."""
    import argparse

    from elastic_gpt.dry_run.cli import _inputs_and_config, add_cli_arguments
    from elastic_gpt.planner.inputs import resolve_model

    path = tmp_path / "job.yaml"
    path.write_text("model:\n  preset: mini\n  family: llama\n  n_kv_head: 2\n"
                    "data:\n  path: unused\n")
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    inputs, cfg = _inputs_and_config(parser.parse_args(
        ["--config", str(path), "--gpu", "A100-80GB", "--gpus", "2"]))
    name, planned = resolve_model(inputs.model, inputs.seq_len, inputs.vocab_size)
    assert (name, planned.family, planned.n_kv_head) == ("custom", "llama", 2)
    assert planned.n_layer == PRESETS["mini"]["n_layer"] and cfg.model.family == "llama"
    gpt = _inputs_and_config(parser.parse_args(
        ["--config", "jobs/configs/mini.yaml", "--gpu", "A100-80GB", "--gpus", "2"]))[0]
    assert gpt.model == "mini"  # a preset kept as the config has it is named


def _saved_full_rows(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the (rows, width) tensors a forward keeps for backward, each storage once (a
    norm's per-row statistics and its gain are not counted)."""
    kept: dict[int, int] = {}

    def pack(t):
        if t.numel() >= x.numel():
            kept[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_keeps_one_fp32_row_per_token_more_than_layernorm_as_the_planner_counts(dtype):
    """What the planner adds to a Llama block's activations (`norm_fp32_copies`, one fp32 row per
    token for each of its two RMSNorms) is what autograd keeps beyond a LayerNorm's input."""
    from elastic_gpt.model.llama import RMSNorm

    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    rms = _saved_full_rows(RMSNorm(256, 1e-5).to(dtype), x)
    layer_norm = _saved_full_rows(torch.nn.LayerNorm(256).to(dtype), x)
    assert rms - layer_norm == 4 * x.numel()
    from elastic_gpt.model.config import GPTConfig

    assert (LlamaConfig.norm_fp32_copies, GPTConfig.norm_fp32_copies) == (2, 0)
