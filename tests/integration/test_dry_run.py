"""`elastic-gpt dry-run`: the trainer's own build and step, at the full world size of a plan, on
torch's fake process group and fake tensors, beside the planner (each rank in a process of its
own). At sizes CI affords: a tensor-parallel HSDP layout of GPT-3 1.3B on 16 A100s, a pipelined
GPT-2 on 8 and a pipelined tensor-parallel Llama on 8; the full GPT-3 175B cases are
bench/bench_dry_run.py's."""

from __future__ import annotations

import json

import pytest

from elastic_gpt.cli import main


def dry_run(capsys, *argv: str) -> tuple[int, dict | str]:
    code = main(["dry-run", *argv])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in argv and code == 0 else out.err.strip())


def rows(rank: dict) -> dict[tuple[str, str], dict]:
    return {(c["dim"], c["kind"]): c for c in rank["collectives"]}


def test_plan_dry_run_steps_a_tensor_parallel_hsdp_layout_as_planned(capsys):
    """`plan --dry-run`: GPT-3 1.3B at tp=2 on 2 nodes of 8, HSDP (FSDP over 4 in a node, 2
    replicas), blocks kept gathered, one gradient sync per step, dry-run for each rank that
    differs (the first, and the last FSDP shard). Every collective the step runs is the
    planner's, in bytes and, for tensor parallelism, in count; the memory at the peak is the
    planner's within 10%."""
    code = main(["plan", "--model", "gpt3-1.3b", "--gpu", "A100-80GB", "--gpus", "16", "--tp", "2",
                 "--dry-run", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    got = json.loads(out.out)
    assert got["plan"]["tp"] == 2 and got["dry_run"]["layout"]["dp_replicate"] == 2
    assert [r["rank"] for r in got["dry_run"]["ranks"]] == [0, 6]
    for rank in got["dry_run"]["ranks"]:
        assert rank["within"] and rank["fits"], rank["total_gib"]
        by = rows(rank)
        for key in [("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                    ("dp_replicate", "all_reduce"), ("tp", "all")]:
            assert by[key]["dry_run_bytes"] == pytest.approx(by[key]["planner_bytes"],
                                                             rel=1e-4), key
        # 24 blocks and the root: one all-gather each per step (kept gathered), one
        # reduce-scatter and one all-reduce across the replicas each (one sync per step).
        assert by["dp_shard", "all_gather"]["count"] == by["dp_shard", "reduce_scatter"]["count"] \
            == by["dp_replicate", "all_reduce"]["count"] == 25
        assert by["tp", "all"]["count"] == by["tp", "all"]["planner_count"] == 926


def test_a_pipelined_tensor_parallel_layout_moves_what_the_planner_counts(capsys):
    """GPT-2 124M at pp=2 x dp=2 x tp=2 on 8 A100s, 1F1B with static stage shapes: both stages
    build and step on the fake group; each rank's pipeline sends, FSDP collectives and
    tensor-parallel collectives (the embeddings' on the first stage only, the output layer's and
    the loss's on the last only) are the planner's, and the first stage's memory is within 10%
    of it."""
    code, got = dry_run(capsys, "--model", "gpt2-124m", "--gpu", "A100-80GB", "--gpus", "8",
                        "--pp", "2", "--tp", "2", "--ranks", "0,4", "--json")
    assert code == 0, got
    first, last = got["ranks"]
    assert (first["coordinate"]["pp"], last["coordinate"]["pp"]) == (0, 1)
    assert first["within"], first["total_gib"]
    for rank in (first, last):
        by = rows(rank)
        for key in [("pp", "send"), ("dp_shard", "all_gather"), ("tp", "all")]:
            assert by[key]["dry_run_bytes"] == pytest.approx(by[key]["planner_bytes"],
                                                             rel=2e-2), (rank["rank"], key)
        assert by["pp", "send"]["dry_run_bytes"] == pytest.approx(
            by["pp", "send"]["planner_bytes"], rel=1e-6)
        assert by["tp", "all"]["count"] == by["tp", "all"]["planner_count"], rank["rank"]
    # The last stage runs the output layer's and the loss's collectives, the first the
    # embeddings': not the same count.
    assert rows(first)["tp", "all"]["count"] != rows(last)["tp", "all"]["count"]


@pytest.mark.parametrize("argv, says", [
    (("--model", "gpt3-1.3b", "--gpu", "A100-80GB", "--gpus", "16", "--tp", "3"),
     "--tp=3"),
    (("--model", "gpt3-13b", "--gpu", "A10G", "--gpus", "8", "--micro-batch-size", "64",
      "--activation-checkpointing", "off"), "fit"),
])
def test_a_layout_that_cannot_build_or_fit_is_one_line_exit_2(capsys, argv, says):
    code, err = dry_run(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert err.startswith("elastic-gpt dry-run: error: ")


def test_a_pipelined_tensor_parallel_llama_steps_as_planned(capsys):
    """A Llama (4 blocks of Llama 3 8B: grouped-query attention, SwiGLU, an untied output layer)
    at tp=2 x pp=2 on 8 A100s, built through its family's spec as the trainer builds it: the
    first stage holds the embedding, the last the final norm and the output layer. Each rank's
    pipeline sends, FSDP and tensor-parallel collectives are the planner's; the first stage's
    activations (a Llama block's: GQA, SwiGLU, RMSNorm's fp32 copies) are the planner's within
    5%, and its total is the planner's or less, within 15%: the planner counts the step's sharded
    gradients beside the micro-batches' activations, where under one gradient sync per step they
    are made only after the last backward (0.0 GiB of them at the dry run's peak)."""
    code, got = dry_run(capsys, "--model", "llama3-8b", "--n-layer", "4", "--global-batch-size",
                        "16", "--gpu", "A100-80GB", "--gpus", "8", "--tp", "2", "--pp", "2",
                        "--ranks", "0,4", "--json")
    assert code == 0, got
    assert got["model"] == "custom" and (got["layout"]["tp"], got["layout"]["pp"]) == (2, 2)
    first, last = got["ranks"]
    assert (first["coordinate"]["pp"], last["coordinate"]["pp"]) == (0, 1)
    activations = first["memory_gib"]["activations"]
    assert activations["planner"] == pytest.approx(activations["dry_run"], rel=0.05), activations
    assert 0 <= first["planner_over_dry_run"] <= 0.15, first["total_gib"]
    for rank in (first, last):
        by = rows(rank)
        for key in [("pp", "send"), ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")]:
            assert by[key]["dry_run_bytes"] == pytest.approx(by[key]["planner_bytes"],
                                                             rel=1e-4), (rank["rank"], key)
        # The tensor-parallel collectives of this stage's blocks and of the root's parts it
        # holds (the untied embedding on the first, the final norm, output layer and loss on the
        # last), as the planner counts a Llama block.
        assert by["tp", "all"]["count"] == by["tp", "all"]["planner_count"], rank["rank"]
        assert by["tp", "all"]["dry_run_bytes"] == pytest.approx(by["tp", "all"]["planner_bytes"],
                                                                 rel=2e-2), rank["rank"]
