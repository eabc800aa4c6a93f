"""Hugging Face checkpoints both ways, against transformers' own models built from a config in
this process (no download):

- our Llama's logits are LlamaForCausalLM's (fp32, atol 1e-5) with and without Llama 3.1's RoPE
  scaling, tied and untied;
- export-hf writes what from_pretrained loads back to the same logits (LlamaForCausalLM, and
  sharded with an index when past the shard size; GPT2LMHeadModel as before);
- a GPT-2 and a Llama directory saved by save_pretrained (transformers 5's config layout; the
  Llama one also in transformers 4's) are imported (`import-hf`) and resumed by the Trainer at
  dp=2, tp=2 and pp=2 with the directory's model's logits and loss; `checkpoint.init_from` reads
  the directory straight into the shards of each rank;
- a directory this trainer cannot build is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_gpt.model.config import LlamaConfig
from elastic_gpt.model.llama import Llama
from elastic_gpt.testing.gloo import run_gloo

V, T = 320, 64  # the byte dataset's vocabulary padded to 64, its samples' length
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def hf_llama(tied: bool = False, scaled: bool = True, original: int = 8192, seed: int = 0):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    rope = ({**SCALING, "original_max_position_embeddings": original} if scaled
            else {"rope_type": "default"})
    cfg = HFLlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                        max_position_embeddings=T, tie_word_embeddings=tied,
                        rope_parameters={**rope, "rope_theta": 500000.0})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers' init leaves the norms at one: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2,
                                      n_head=2, activation_function="gelu_new")).eval()


def ours_of(hf) -> Llama:
    """Our Llama of the same shape holding the same weights (the key map under test)."""
    from elastic_gpt.model.families import FAMILIES

    c = hf.config
    scaling = getattr(c, "rope_parameters", None) or {}
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=T, vocab_size=V,
                      ffn_hidden=64, tie_embeddings=c.tie_word_embeddings,
                      rope_factor=scaling.get("factor"),
                      rope_original_seq_len=scaling.get("original_max_position_embeddings", 8192))
    ours = Llama(cfg)
    theirs = hf.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(theirs[FAMILIES["llama"].hf_name(name)[0]])
    return ours.eval()


def tokens(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (rows, T), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scaled", [True, False], ids=["rope-scaled", "rope-plain"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_are_llama_for_causal_lm_logits(scaled, tied):
    # a short original context, so the scaling moves frequencies this context uses
    hf = hf_llama(tied=tied, scaled=scaled, original=16)
    ours = ours_of(hf)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)
    if scaled:  # the check can fail: the same weights without the scaling give other logits
        plain = hf_llama(tied=tied, scaled=False)
        plain.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert (plain(x).logits - hf(x).logits).abs().max() > 1e-3


def _checkpoint_of(model, root) -> str:
    """`model` as a committed checkpoint (what a run saves), for export-hf."""
    from elastic_gpt.checkpoint.sharded import save_sharded
    from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname

    store = CheckpointStore(str(root))
    store.prepare_step_dir(3)
    save_sharded(store.url(step_dirname(3)), model, None)
    store.commit(3, {"step": 3, "samples_seen": 3, "model_shape": model.cfg.shape()})
    return str(root)


@pytest.mark.parametrize("shard_bytes", [None, 50_000], ids=["one-file", "sharded"])
def test_export_then_from_pretrained_gives_the_same_logits(shard_bytes, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from elastic_gpt.inference.hf_export import MAX_SHARD_BYTES, export_hf

    ours = ours_of(hf_llama())
    out = tmp_path / "hf"
    export_hf(_checkpoint_of(ours, tmp_path / "ckpt"), str(out),
              max_shard_bytes=shard_bytes or MAX_SHARD_BYTES)
    files = sorted(os.listdir(out))
    if shard_bytes:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert all(f in files for f in index["weight_map"].values())
    else:
        assert "model.safetensors" in files
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_scaling"]["rope_type"] == "llama3"  # transformers 4's layout
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(back, LlamaForCausalLM)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), rtol=0, atol=1e-5)


# ---- import, then resume at any layout -------------------------------------------------------


def save_dir(model, path, transformers4: bool = False) -> str:
    model.save_pretrained(str(path))
    if transformers4:  # the published Llama 3 directories' layout: theta and scaling on top
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _resumed_worker(rank: int, world: int, overrides: list[str], x: torch.Tensor) -> dict:
    from elastic_gpt.config import load_config
    from elastic_gpt.parallel.tensor import summed_token_loss
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    trainer.restore()
    inputs, targets = x[:, :-1], x[:, 1:]
    out = {"step": trainer.step, "setup": trainer.setup_line()}
    if trainer.pipeline is not None:
        loss = trainer.pipeline.evaluate(inputs, targets, trainer.compute_dtype,
                                         trainer.dims.loss_parallel, trainer.device)
        return {**out, "loss": float(loss) if trainer.pipeline.last else None}
    with torch.no_grad():
        logits = trainer.model(inputs)
        with summed_token_loss(trainer.model, inputs, targets, compute_dtype=torch.float32,
                               vocab_sharded=trainer.dims.loss_parallel) as loss:
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {**out, "loss": float(loss), "logits": logits}


LAYOUTS = {"dp2": ["parallel.tp=1"], "tp2": ["parallel.tp=2"],
           "pp2": ["parallel.pp=2", "parallel.tp=1"]}


def resume(data: str, ckpt: str, layout: str, model_keys: list[str], x) -> list[dict]:
    overrides = [f"data.path={data}", "train.global_batch_size=4", "train.micro_batch_size=2",
                 "scaling.min_workers=2", "scaling.max_workers=2", "eval.samples=0",
                 f"checkpoint.path={ckpt}", *model_keys, *LAYOUTS[layout]]
    return run_gloo(_resumed_worker, 2, overrides, x)


def expected(hf, x) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        logits = hf(x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1),
                                             reduction="sum")
    return logits, float(loss)


def check_resumed(ranks: list[dict], logits, loss, layout: str) -> None:
    assert all(r["step"] == 0 for r in ranks)
    assert any({"dp2": "dp 2", "tp2": "tp 2", "pp2": "pp 2"}[layout] in r["setup"] for r in ranks)
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses and all(v == pytest.approx(loss, rel=1e-5) for v in losses)
    for r in ranks:
        if "logits" in r:
            torch.testing.assert_close(r["logits"], logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Llama (transformers 4's config layout) and a GPT-2 directory, each imported."""
    from elastic_gpt.inference.hf_import import import_hf, training_overrides

    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, model, t4 in (("llama", hf_llama(seed=1), True), ("gpt2", hf_gpt2(seed=2), False)):
        directory = save_dir(model, root / f"{name}-hf", transformers4=t4)
        _, cfg = import_hf(directory, str(root / f"{name}-ckpt"), seq_len=T)
        out[name] = (model, str(root / f"{name}-ckpt"), training_overrides(cfg).split(),
                     directory)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_an_imported_directory_resumes_at_any_layout(imported, family, layout, stdlib_dataset):
    hf, ckpt, keys, _ = imported[family]
    x = tokens(4)
    x = torch.cat([x, x[:, :1]], dim=1)  # T + 1 tokens: inputs and targets
    logits, loss = expected(hf, x)
    check_resumed(resume(stdlib_dataset, ckpt, layout, keys, x), logits, loss, layout)


@pytest.mark.parametrize("family,layout", [("llama", "tp2"), ("llama", "pp2"), ("gpt2", "tp2")])
def test_init_from_reads_the_directory_into_each_ranks_shards(imported, family, layout,
                                                             stdlib_dataset, tmp_path):
    """Each rank reads its own slices: GPT-2's fused c_attn at tp=2 is three runs of rows of
    each rank's heads, read from the columns of Hugging Face's transposed Conv1D weight."""
    hf, _, _, directory = imported[family]
    x = tokens(4)
    x = torch.cat([x, x[:, :1]], dim=1)
    logits, loss = expected(hf, x)
    ranks = resume(stdlib_dataset, str(tmp_path / "fresh"), layout,
                   [f"checkpoint.init_from={directory}"], x)
    check_resumed(ranks, logits, loss, layout)


# ---- bad directories: one line, exit 2 ---------------------------------------------------------


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_gpt.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_a_directory_this_trainer_cannot_build_is_one_line_exit_2(imported, tmp_path):
    _, _, _, good = imported["llama"]
    cases = {}
    for name, change in (("mistral", {"model_type": "mistral"}),
                         ("biased", {"attention_bias": True}),
                         ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads(open(os.path.join(good, "config.json")).read())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        os.symlink(os.path.join(good, "model.safetensors"), d / "model.safetensors")
        cases[name] = (str(d), {"mistral": "model_type='mistral'", "biased": "attention_bias",
                                "yarn": "rope_type='yarn'"}[name])
    # weights with biases Llama has none of, under a config that says Llama
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bias-weights"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(good, "config.json")).read())
    weights = load_file(os.path.join(good, "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(weights, str(d / "model.safetensors"))
    cases["bias-weights"] = (str(d), "q_proj.bias, which the llama model here has no place for")
    cases["missing"] = (str(tmp_path / "nowhere"), "is not a directory")
    for name, (directory, words) in cases.items():
        out = tmp_path / f"{name}-ckpt"
        r = _cli("import-hf", directory, "--out", str(out))
        assert r.returncode == 2, (name, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elastic-gpt import-hf: error: "), r.stderr
        assert words in lines[0], (name, lines[0])
        assert not out.exists() or not any(out.iterdir()), name
