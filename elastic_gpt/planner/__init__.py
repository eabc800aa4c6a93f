"""Capacity planning: `elastic-gpt plan` (first-order models, before renting) and `elastic-gpt
tune` (the same questions measured on the cluster's workers).

Lowest first; a module imports only the ones listed before it:

- inputs.py: `PlanInputs`, `PlanError`, the units.
- memory.py: the model's shape and the bytes one GPU holds at its peak.
- step_time.py: the network, the mesh, one step's compute and communication; `LayoutCandidate`.
- reliability.py: the restart path's goodput and checkpoint interval (Young/Daly).
- replica_group_model.py: goodput and cost of `elastic.replica_groups: N` against the restart path.
- search.py: the layouts weighed (tensor parallelism, HSDP, micro-batch, ...), replica-group
  layouts, and what would fit when nothing does.
- training_plan.py: `plan_training` -> `Plan`, the defaults it recommends.
- report.py: the text report, the JSON summary and the training config written.
- cli.py: the `plan` command's flags and exit codes.
- tune_candidates.py: `tune`'s candidates and the planner's pre-check and predictions for them.
- tune_worker.py: what each `tune` worker runs and measures (peak memory, step time).
- tune.py: the `tune` command: the Ray Train job, the table, the config written.
"""
