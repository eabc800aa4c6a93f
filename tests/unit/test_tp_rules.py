"""One tensor-parallel rule: config validation, the planner, `tune`, the mesh and replica-group
sizing give the same verdict on the same degree (parallel/tp_rules.py)."""

import pytest

from elastic_gpt.errors import PlacementError
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.parallel.mesh import ParallelDims
from elastic_gpt.parallel.tp_rules import model_problem, nodes_problem, usable_degrees, workers_problem
from elastic_gpt.planner.search import tp_problem as plan_tp_problem
from elastic_gpt.planner.tune_candidates import tp_problem as tune_tp_problem
from elastic_gpt.train.model_config import check_tensor_parallel


def _gpt(n_head=12, seq_len=1024, vocab_size=50304):
    return GPTConfig(n_layer=2, n_head=n_head, n_embd=n_head * 8, seq_len=seq_len,
                     vocab_size=vocab_size)


@pytest.mark.parametrize("gpt", [_gpt(), _gpt(n_head=16), _gpt(seq_len=1022), _gpt(vocab_size=50260)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_config_planner_and_tune_agree_on_the_model(gpt, tp):
    verdict = model_problem(tp, n_head=gpt.n_head, seq_len=gpt.seq_len, vocab_size=gpt.vocab_size)
    try:
        check_tensor_parallel(gpt, tp)
        config_ok = True
    except ValueError:
        config_ok = False
    assert config_ok == (verdict is None)
    assert (plan_tp_problem(tp, gpt, 64, 8) is None) == (verdict is None)
    # tune does not know the vocabulary before it reads the data: heads and sequence only
    assert (tune_tp_problem(tp, 8, gpt.n_head, gpt.seq_len) is None) == \
        (model_problem(tp, n_head=gpt.n_head, seq_len=gpt.seq_len) is None)


def test_the_vocabulary_counts():
    assert "model.vocab_size=50260" in model_problem(8, n_head=16, seq_len=1024, vocab_size=50260)
    assert usable_degrees(16, 1024, 50260) == [1, 2, 4]


def test_workers_come_in_whole_groups_and_groups_stay_in_a_node():
    assert workers_problem(2, {"a": 4, "b": 8}) is None
    line = workers_problem(4, {"scaling.min_workers": 2, "scaling.max_workers": 6})
    assert "e.g. scaling.min_workers=4 scaling.max_workers=4" in line
    assert nodes_problem(2, [2, 4]) is None
    with pytest.raises(PlacementError, match="not all multiples of parallel.tp=2"):
        ParallelDims.for_nodes(4, tp=2, hsdp="auto", rank_nodes=["a", "a", "a", "b"])
    assert "not all multiples" in nodes_problem(2, [3, 1])
