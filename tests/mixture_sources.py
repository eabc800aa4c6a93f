"""Three byte-tokenized datasets of different sizes, for the mixture tests: mixed by weight, one is
sampled up and another down."""

from __future__ import annotations

import random

from data_pipelines.tokenize_job import prepare_data


def _corpus(root, n_files: int, seed: int, words: tuple[str, ...]):
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(n_files):
        (root / f"{i:02d}.txt").write_text(" ".join(rng.choice(words)
                                                    for _ in range(rng.randint(80, 300))))


def make_sources(root) -> list[str]:
    """The three datasets under `root` (a pathlib.Path); their URLs."""
    out = []
    for name, n_files, words in (("code", 8, ("def", "return", "x", "\n")),
                                 ("prose", 3, ("the", "cat", "sat", "ünï")),
                                 ("tiny", 1, ("a", "b"))):
        _corpus(root / "raw" / name, n_files, len(out), words)
        prepare_data(str(root / "raw" / name), str(root / name), "bytes", 16, engine="local",
                     progress=False, part_bytes=1500)
        out.append(str(root / name))
    return out
