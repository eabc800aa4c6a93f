"""Reading a dataset's steps back the way every rank of a group reads them, for the data-order
tests (C2 data order): the rows each run position got and each step's fingerprint."""

from __future__ import annotations

from elastic_gpt.data.stream import open_step_stream

SEED, WINDOW = 7, 64  # a window smaller than the dataset exercises the windowed shuffle


def run_positions(url, plan, world_size, steps, start_step=0, **kw):
    """{run position: row bytes} and the global fingerprint per step, from W rank streams."""
    rows, fps = {}, {}
    for rank in range(world_size):
        with open_step_stream(url, batch_split=plan, rank=rank, world_size=world_size,
                              start_step=start_step, seed=SEED, shuffle_window=WINDOW, **kw) as s:
            mine = list(plan.rank_micro_batches(rank, world_size))
            for t in range(start_step, start_step + steps):
                b = next(s)
                assert b.step == t and len(b.tokens) == plan.slots(world_size)
                fps[t] = (fps.get(t, 0) + b.fingerprint) % 2**52
                for slot, j in enumerate(mine):
                    assert b.weights[slot] == 1.0
                    pos = plan.micro_batch_positions(t, j)
                    for i, p in enumerate(pos):
                        rows[p] = b.tokens[slot][i].numpy().astype("<u2").tobytes()
    return rows, fps
