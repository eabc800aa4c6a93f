"""A Hugging Face model directory as a source of weights: its config.json read into our model
shape, and its safetensors (one file, or shards with an index) read into a model of any layout,
each rank reading only the slices of each weight its shards hold.

So a model larger than one host's memory starts from a published checkpoint with every rank
reading its own share (`checkpoint.init_from`), and `elastic-gpt import-hf` reads the same way
into one process. Nothing is unpickled: only safetensors are read (a pytorch_model.bin would run
pickled code). What the directory holds must be exactly the model: a weight it lacks, one of
another shape, or one the model has no place for (a bias where Llama has none) is one
ValueError line. torch and safetensors are imported when weights are read, not for the config.
"""

from __future__ import annotations

import json
import os

from elastic_gpt.model.families import config_from_hf, spec_of
from elastic_gpt.model.hf_layouts import HF_CONFIG, HFLayoutError

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
# Buffers some exports carry that are not weights: GPT-2's causal masks, old Llama rotary tables.
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def read_hf_config(directory: str) -> dict:
    if "://" in directory:
        raise HFLayoutError(f"{directory} is a URL; a Hugging Face directory is read from local "
                            "disk (download it first, e.g. with huggingface-cli download)")
    if not os.path.isdir(directory):
        raise HFLayoutError(f"{directory} is not a directory; pass a Hugging Face model "
                            "directory (config.json and model.safetensors)")
    path = os.path.join(directory, HF_CONFIG)
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise HFLayoutError(f"{directory} has no {HF_CONFIG}; pass a Hugging Face model "
                            "directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFLayoutError(f"{path} cannot be read as JSON ({e}); fix or replace it") from None
    if not isinstance(hf, dict):
        raise HFLayoutError(f"{path} is not a JSON object; fix or replace it")
    return hf


def hf_directory_config(directory: str, seq_len: int | None, dropout: float = 0.0):
    """Our model config for the directory's model at context `seq_len` (None: the directory's)."""
    import dataclasses

    cfg = config_from_hf(read_hf_config(directory), seq_len, os.path.join(directory, HF_CONFIG))
    return dataclasses.replace(cfg, dropout=dropout) if dropout else cfg


def directory_tokenizer_vocab(directory: str) -> int | None:
    """The vocabulary of the directory's tokenizer.json (added tokens included), or None if it
    ships none."""
    path = os.path.join(directory, TOKENIZER)
    if not os.path.isfile(path):
        return None
    from elastic_gpt.data.tokenizers import HFTokenizer

    return HFTokenizer(path).vocab_size


class HFWeights:
    """The tensors of a directory's safetensors, by name, read slice by slice."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, WEIGHTS_INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.files = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFLayoutError(f"{index} is not a safetensors index ({e}); fix or replace "
                                    "it") from None
        elif os.path.isfile(os.path.join(directory, WEIGHTS)):
            self.files = None
        else:
            bins = [n for n in os.listdir(directory) if n.endswith(".bin")]
            raise HFLayoutError(
                f"{directory} has no {WEIGHTS} or {WEIGHTS_INDEX}"
                + (f" ({bins[0]} is a pickle, which is never read: it could run code)" if bins
                   else "") + "; save the model with safetensors (save_pretrained does)")
        self._open: dict[str, object] = {}
        if self.files is None:
            self.files = dict.fromkeys(self._handle(WEIGHTS).keys(), WEIGHTS)

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            path = os.path.join(self.directory, file)
            try:
                self._open[file] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types, and OSError
                raise HFLayoutError(f"{path} cannot be read as safetensors "
                                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__});"
                                    " re-download or re-save it") from None
        return self._open[file]

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, indices: list, transposed: bool):
        """The elements of tensor `name` at `indices` (one index tensor per dim of OUR layout,
        global indices) as a float32 tensor in our layout: each run of consecutive indices is
        one slice read, so a shard reads its own rows and columns only."""
        import itertools

        import torch

        part = self._handle(self.files[name]).get_slice(name)
        stored = list(reversed(indices)) if transposed else list(indices)
        out = torch.empty([len(i) for i in stored], dtype=torch.float32)
        for box in itertools.product(*[_runs(i) for i in stored]):
            src = tuple(slice(a, b) for a, b, _ in box)
            dst = tuple(slice(at, at + b - a) for a, b, at in box)
            out[dst] = part[src if len(src) > 1 else src[0]].float()
        return out.t() if transposed else out

    def close(self) -> None:
        self._open.clear()


def _runs(indices) -> list[tuple[int, int, int]]:
    """(start, stop, position in `indices`) per run of consecutive global indices."""
    idx = indices.tolist()
    runs, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        runs.append((idx[i], idx[j] + 1, i))
        i = j + 1
    return runs


def load_hf_weights(model, directory: str) -> None:
    """Fill every parameter this rank holds of `model` (a whole model, a sharded one, or a
    pipeline rank's part) from the directory's weights, each DTensor shard from its own slices.
    The directory must hold every weight of the model, in its shape, and nothing else but
    buffers that are not weights."""
    import torch
    from torch.distributed.tensor import DTensor

    from elastic_gpt.model.gpt import plain_name
    from elastic_gpt.torch_internals import local_indices

    cfg = model.cfg
    spec = spec_of(cfg)
    weights = HFWeights(directory)
    try:
        available = weights.names()
        wanted = {}
        for name in _whole_model_names(cfg):
            key, transposed = spec.hf_name(name)
            # exports of the base model alone (GPT-2's own hub files) leave its prefix out
            found = next((k for k in (key, key.removeprefix(spec.hf_base_prefix))
                          if k in available), None)
            if found is None:
                raise HFLayoutError(f"{directory} has no weight {key}, which the {spec.name} "
                                    f"model of its config.json has; the weights and config.json "
                                    "disagree")
            wanted[name] = (found, transposed)
        used = {k for k, _ in wanted.values()}
        extra = sorted(k for k in available - used if not k.endswith(_NOT_WEIGHTS)
                       and not (spec.tied(cfg) and k.endswith("lm_head.weight")))
        if extra:
            raise HFLayoutError(f"{directory} holds {extra[0]}"
                                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                                + f", which the {spec.name} model here has no place for"
                                + (" (Llama has no biases)" if extra[0].endswith(".bias") else "")
                                + "; use a directory of the model its config.json describes")
        with torch.no_grad():
            for name, p in model.named_parameters():
                key, transposed = wanted[plain_name(name)]
                stored = weights.shape(key)
                theirs = tuple(reversed(stored)) if transposed else stored
                if not _fits(theirs, tuple(p.shape), cfg, plain_name(name)):
                    raise HFLayoutError(f"{directory}: {key} has shape {stored}, and the model "
                                        f"of its config.json needs {tuple(p.shape)}; the weights "
                                        "and config.json disagree")
                if isinstance(p, DTensor):
                    held = local_indices(p.shape, p.device_mesh, p.placements)
                    p.to_local().copy_(weights.read(key, held, transposed))
                else:
                    held = [torch.arange(n) for n in p.shape]
                    p.copy_(weights.read(key, held, transposed))
    finally:
        weights.close()


def _whole_model_names(cfg) -> list[str]:
    """Every parameter name of the whole model, built on "meta" (no memory)."""
    import torch

    from elastic_gpt.model.families import build_model

    with torch.device("meta"):
        return [name for name, _ in build_model(cfg).named_parameters()]


def _fits(theirs: tuple, ours: tuple, cfg, name: str) -> bool:
    """Same shape; learned positions may have more rows than the training context uses."""
    if theirs == ours:
        return True
    return (cfg.position_embedding and name == "wpe.weight" and theirs[1:] == ours[1:]
            and theirs[0] >= ours[0])
