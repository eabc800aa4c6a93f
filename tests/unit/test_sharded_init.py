"""Weight init by tiles: the tiles a rank draws are the same whoever asks for them."""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.model.gpt import init_tiles


def test_tiles_are_the_same_whoever_asks():
    shape = (20, 30)
    whole = init_tiles(3, 7, shape, torch.arange(20), torch.arange(30), 0.02)
    rows, cols = torch.tensor([19, 0, 5, 6, 7]), torch.tensor([29, 8, 9, 10])
    part = init_tiles(3, 7, shape, rows, cols, 0.02)
    torch.testing.assert_close(part, whole[rows][:, cols], rtol=0, atol=0)
    other = init_tiles(4, 7, shape, torch.arange(20), torch.arange(30), 0.02)
    assert not torch.equal(whole, other)  # another seed, other weights
    assert whole.std().item() == pytest.approx(0.02, rel=0.15)


