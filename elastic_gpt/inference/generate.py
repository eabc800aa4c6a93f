"""Load a trained model from a checkpoint URL on one process, and sample from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_gpt.checkpoint.sharded import load_model_weights
from elastic_gpt.checkpoint.store import COMMIT_MARKER, CheckpointStore
from elastic_gpt.errors import user_error_line
from elastic_gpt.model.config import config_from_shape
from elastic_gpt.model.families import build_model
from elastic_gpt.model.gpt import Decoder


def resolve_checkpoint(url: str) -> tuple[str, dict]:
    """A run's checkpoint root (newest committed step) or one step's directory -> (url, state).
    Storage that refuses access or cannot be reached is a ValueError naming the URL."""
    try:
        return _resolve_checkpoint(url)
    except ValueError:
        raise
    except Exception as e:
        line = user_error_line(e)
        if line is None:
            raise
        raise ValueError(f"checkpoint {url} cannot be read: {line}") from e


def _resolve_checkpoint(url: str) -> tuple[str, dict]:
    store = CheckpointStore(url)
    if store.fs.exists(store.path(COMMIT_MARKER)):
        parent, _, name = store.root_url.rpartition("/")
        step = int(name.removeprefix("step_"))
        problem = CheckpointStore(parent).verify(step)
        if problem:
            raise ValueError(f"checkpoint {url} is not usable: {problem}")
        return store.root_url, CheckpointStore(parent).read_state(step)
    latest = store.latest()
    if latest is None:
        raise ValueError(f"no committed checkpoint under {url}; pass a run's checkpoint.path or "
                         "one of its step_<N> directories")
    return latest.url, latest.state


def load_model(url: str) -> tuple[Decoder, dict]:
    step_url, state = resolve_checkpoint(url)
    return model_at(step_url, state), state


def model_at(step_url: str, state: dict) -> Decoder:
    """The checkpoint's model (of its family) in one process, on "meta" first so the weights are
    allocated once, by the load."""
    with torch.device("meta"):
        model = build_model(config_from_shape(state["model_shape"]))
    model.to_empty(device="cpu")
    load_model_weights(step_url, model)
    model.eval()
    return model


def checkpoint_tokenizer(step_url: str, state: dict):
    """(tokenizer, end-of-text id) of a checkpoint: the copy in its step folder when it has one,
    so the checkpoint alone is enough; else (checkpoints written before they carried one) the
    tokenizer its dataset's manifest names."""
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.tokenizers import get_tokenizer

    info = state.get("tokenizer")
    if info:
        return get_tokenizer(info["name"], base=step_url), int(info["eos_id"])
    manifest = load_manifest(state["data"]["url"])
    return get_tokenizer(manifest.tokenizer, base=manifest.url), manifest.eos_id


@torch.no_grad()
def generate(model: Decoder, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int | None = None,
             eos_id: int | None = None,
             first_allowed: torch.Tensor | None = None) -> torch.Tensor:
    """idx (1, T) -> (1, T + n). temperature 0 is greedy (argmax), hence deterministic.
    `first_allowed`: a (vocab,) bool mask the first new token must be in (token healing)."""
    if temperature < 0 or max_new_tokens < 1:  # a negative temperature samples the least likely
        raise ValueError(f"temperature={temperature} must be >= 0 and max_new_tokens="
                         f"{max_new_tokens} at least 1")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for i in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1, :].float()  # (1, vocab)
        if i == 0 and first_allowed is not None:
            logits = logits.masked_fill(~first_allowed, float("-inf"))
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
        if eos_id is not None and int(nxt) == eos_id:
            break
    return idx


def sample_text(checkpoint: str, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
                seed: int | None = 0) -> str:
    step_url, state = resolve_checkpoint(checkpoint)
    model = model_at(step_url, state)
    tok, eos_id = checkpoint_tokenizer(step_url, state)
    head, tail = heal_prompt(prompt)
    ids = tok.encode(head) or [eos_id]
    allowed = tokens_starting_with(tok, tail, model.cfg.vocab_size) if tail else None
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature, seed=seed,
                   eos_id=eos_id, first_allowed=allowed)
    new = [i for i in out[0, len(ids):].tolist() if i < tok.vocab_size]
    return head + tok.decode(new)


def heal_prompt(prompt: str) -> tuple[str, str]:
    """(what to encode, what the first new token must start with). A BPE merges a word's
    leading space into the word, so a prompt ending in a space (`def `) would end on a lone
    space token that training text almost never has before a name; instead the space is left
    to the model's first token (token healing)."""
    head = prompt.rstrip(" ")
    return (head, prompt[len(head):]) if head else (prompt, "")


def tokens_starting_with(tok, text: str, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) bool: the ids whose text starts with `text`."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(min(tok.vocab_size, vocab_size)):
        mask[i] = tok.decode([i]).startswith(text)
    return mask
