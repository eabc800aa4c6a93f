"""Weighted mixtures (data.sources): the interleave keeps C2 data order exactly (a pure function of
the manifests, weights, seed and epoch; the same at W=1, 2 and 4; resumable mid-epoch at another
W), proportions follow the weights, sources must share tokenizer and seq_len, and the trainer
logs the samples it has seen of each source (tests/integration/test_data_mixture.py)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from data_pipelines.tokenize_job import prepare_data
from elastic_gpt.data.mixture import (
    MixtureOrder,
    load_training_manifest,
    mixture_quotas,
    open_training_data,
)
from elastic_gpt.data.order import BatchSplit, SampleOrder
from elastic_gpt.data.stream import open_step_stream
from tests.mixture_sources import make_sources

SEED, WINDOW = 11, 32


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three byte datasets of different sizes (so up- and down-sampling both happen)."""
    return make_sources(tmp_path_factory.mktemp("mix"))


def _data(paths, weights):
    return SimpleNamespace(path="", sources=[{"path": p, "weight": w}
                                             for p, w in zip(paths, weights)])


def test_any_slice_of_the_order_equals_the_whole_and_counts_add_up():
    order = MixtureOrder([[30, 20], [7], [100, 3, 40]], [1.0, 2.0, 0.5], seed=5, window=16)
    E = order.epoch_samples
    assert E == 200 and sum(order.quotas) == E and order.quotas == mixture_quotas(
        [50, 7, 143], [1.0, 2.0, 0.5])
    whole = order.samples_at(0, 3 * E)
    for a, b in [(0, 5), (17, 80), (E - 3, E + 9), (2 * E + 1, 3 * E)]:
        assert order.samples_at(a, b) == whole[a:b], (a, b)
    for stop in (0, 1, 50, E, E + 33, 3 * E):
        seen = Counter(s for s, _, _ in whole[:stop])
        assert [seen[i] for i in range(3)] == order.source_counts(stop)
    # A pure function of its inputs: built again, the same; another seed, another interleave.
    again = MixtureOrder([[30, 20], [7], [100, 3, 40]], [1.0, 2.0, 0.5], seed=5, window=16)
    assert again.samples_at(0, E) == whole[:E]
    assert MixtureOrder([[30, 20], [7], [100, 3, 40]], [1.0, 2.0, 0.5], seed=6,
                        window=16).samples_at(0, E) != whole[:E]


def test_proportions_follow_the_weights_in_every_window():
    sizes, weights = [[500], [60], [9000]], [3.0, 1.0, 1.0]
    order = MixtureOrder(sizes, weights, seed=1, window=64)
    share = [w / sum(weights) for w in weights]
    for start in (0, 1234, order.epoch_samples - 50):
        got = Counter(s for s, _, _ in order.samples_at(start, start + 100))
        for i in range(3):  # a smooth interleave: each source within a sample or two of its share
            assert abs(got[i] - 100 * share[i]) <= 2, (start, i, got)


def test_up_and_down_sampled_sources_repeat_only_after_a_full_pass():
    sizes, weights = [[40], [400]], [1.0, 1.0]  # each gets 220 of an epoch's 440 positions
    order = MixtureOrder(sizes, weights, seed=3, window=16)
    first = order.samples_at(0, order.epoch_samples)
    small = [(sh, r) for s, sh, r in first if s == 0]
    big = [(sh, r) for s, sh, r in first if s == 1]
    assert len(small) == len(big) == 220
    # Up-sampled: 5.5 passes over the small source, every pass a permutation of all of it.
    for k in range(5):
        assert sorted(small[k * 40:(k + 1) * 40]) == [(0, i) for i in range(40)]
    # Down-sampled: the big source's first epoch has no repeat, and the next mixture epoch
    # continues with its remaining samples before any repeats.
    nxt = [(sh, r) for s, sh, r in order.samples_at(order.epoch_samples,
                                                    2 * order.epoch_samples) if s == 1]
    assert len(set(big)) == 220 and sorted(big + nxt[:180]) == [(0, i) for i in range(400)]


def _run_rows(data, plan, world, steps, start=0):
    """{run position: record bytes} and per-step fingerprints, from `world` rank streams."""
    rows, fps = {}, {}
    for rank in range(world):
        with open_step_stream(data, batch_split=plan, rank=rank, world_size=world, start_step=start,
                              seed=SEED, shuffle_window=WINDOW, prefetch_steps=0) as stream:
            mine = list(plan.rank_micro_batches(rank, world))
            for t in range(start, start + steps):
                batch = next(stream)
                fps[t] = (fps.get(t, 0) + batch.fingerprint) % 2**52
                for slot, j in enumerate(mine):
                    for i, p in enumerate(plan.micro_batch_positions(t, j)):
                        rows[p] = batch.tokens[slot][i].numpy().tobytes()
    return rows, fps


def test_mixture_stream_is_identical_at_world_sizes_1_2_4_and_resumes_mid_epoch(sources):
    data = open_training_data(_data(sources, [2.0, 1.0, 0.5]))
    plan = BatchSplit(global_batch_size=12, micro_batch_size=1)
    steps = data.epoch_samples // 12 + 3  # past the end of the first mixture epoch
    one = _run_rows(data, plan, 1, steps)
    assert _run_rows(data, plan, 2, steps) == one
    assert _run_rows(data, plan, 4, steps) == one
    # A resume at another world size in the middle of the epoch sees the same samples.
    mid = steps // 2
    rows, fps = _run_rows(data, plan, 3, steps - mid, start=mid)
    assert fps == {t: one[1][t] for t in range(mid, steps)}
    assert rows == {p: r for p, r in one[0].items() if p >= mid * 12}
    # What each position holds is the record the order names, of the source it names.
    order = data.make_order(SEED, WINDOW)
    reader = data.make_reader()
    for p in (0, 5, 77, steps * 12 - 1):
        (triple,) = order.samples_at(p, p + 1)
        records, _ = reader.read([triple])
        assert records[0].astype("int64").tobytes() == one[0][p]


def test_one_source_is_exactly_the_plain_dataset_order(sources):
    data = open_training_data(SimpleNamespace(path=sources[0], sources=None))
    plan = BatchSplit(global_batch_size=8, micro_batch_size=2)
    assert _run_rows(data, plan, 2, 5) == _run_rows(sources[0], plan, 2, 5)
    order = data.make_order(SEED, WINDOW)
    assert isinstance(order, SampleOrder) and not data.is_mixture
    assert load_training_manifest(SimpleNamespace(path=sources[0], sources=None)).url == \
        sources[0]


def test_sources_must_share_tokenizer_and_seq_len(sources, tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("other sequence length " * 40)
    prepare_data(str(tmp_path / "raw"), str(tmp_path / "long"), "bytes", 32, engine="local",
                 progress=False)
    with pytest.raises(ValueError, match=r"data\.sources\[1\] \(.*long\) has seq_len=32 but the "
                                         r"training data .* has seq_len=16; re-run prepare-data"):
        load_training_manifest(_data([sources[0], str(tmp_path / "long")], [1.0, 1.0]))
    with pytest.raises(ValueError, match="is not a prepared dataset"):
        load_training_manifest(_data([sources[0], str(tmp_path / "missing")], [1.0, 1.0]))


