"""Small corpora in every input format prepare-data reads (JSON lines, gzip and zstd
compressed, plain files, parquet), Python sources for the tokenizer trainer, and a digest of what
a job wrote."""

from __future__ import annotations

import gzip
import hashlib
import json
import os

DOCS = [
    "Hello, world!\nThis is the first document.\n",
    "Ünïcödé ✓ — emoji 😀 and CJK 漢字, tabs\tand trailing spaces   \n",
    "a literal <|endoftext|> inside a document is plain text",
    "def f(x):\n    return x * 2\n" * 40,
    "short",
]


def write_corpus(root, docs=DOCS):
    """The same documents in every input format the job reads."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "a.jsonl"), "w", encoding="utf-8") as f:
        for d in docs[:2]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    with gzip.open(os.path.join(root, "b.jsonl.gz"), "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[2]}) + "\n")
    with open(os.path.join(root, "c.py"), "w", encoding="utf-8") as f:
        f.write(docs[3])
    import zstandard

    with open(os.path.join(root, "d.txt.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(docs[4].encode()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["parquet row one", "parquet row two ✓"]}),
                   os.path.join(root, "e.parquet"))
    return docs + ["parquet row one", "parquet row two ✓"]


def dir_digest(path, prefix=""):
    """sha256 of every file under `path`, by relative name (the val/ split included)."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isdir(full):
            out.update(dir_digest(full, prefix + name + "/"))
            continue
        with open(full, "rb") as f:
            out[prefix + name] = hashlib.sha256(f.read()).hexdigest()
    return out


PYTHON_SOURCES = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "# coding: utf-8\nNAME = 'café ☕'\n\n\nif __name__ == '__main__':\n\tprint(NAME)\n",
    "import os\n\n\ndef main():\n    for root, dirs, files in os.walk('.'):\n        pass\n",
] + [f"def f{i}(x):\n    return x * {i}  # {'ü' * (i % 3)}\n" for i in range(40)]


def write_python_sources(folder):
    """PYTHON_SOURCES as files m00.py, m01.py, ... in `folder` (a pathlib.Path, made here)."""
    folder.mkdir()
    for i, t in enumerate(PYTHON_SOURCES):
        (folder / f"m{i:02d}.py").write_text(t, encoding="utf-8")
    return folder
