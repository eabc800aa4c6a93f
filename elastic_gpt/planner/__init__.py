"""Capacity planning: `elastic-gpt plan` (first-order models, before renting) and `elastic-gpt
tune` (the same questions measured on the cluster's workers). What a layout costs, memory and
step time, is the cost model's (elastic_gpt/cost_model/); the planner weighs layouts with it
and adds what a run's failures, checkpoints and price make of them.

Lowest first; a module imports only the ones listed before it:

- inputs.py: `PlanInputs` (what a plan is asked, with the assumptions' defaults), `PlanError`,
  the units.
- calibration_fit.py: measured runs (`MeasuredRun`, each model as it ran), each planned in its
  own layout, and the calibration's terms fitted to them.
- calibration_file.py: a measured calibration as JSON (`plan --calibration FILE`): its format,
  its one-line errors, its writers' document.
- reliability.py: the restart path's goodput and checkpoint interval (Young/Daly), loss spikes.
- restart_cost.py: what one restart costs, term by term (detection, restart, compilation, the
  checkpoint read).
- replica_group_model.py: goodput and cost of `elastic.replica_groups: N` against the restart
  path, and the cross-group all-reduce.
- search.py: the layouts weighed (tensor and pipeline parallelism, HSDP, micro-batch,
  checkpointing, gradient sync, resharding), the replica-group layouts, and what would fit when
  nothing does.
- training_plan.py: `plan_training` -> `Plan`, and the defaults it recommends (GPT-3's batch and
  learning rate).
- report.py: the text report, the JSON summary and the training config written.
- cli.py: the `plan` command's flags and exit codes.
- tune_candidates.py: `tune`'s candidates and the planner's pre-check and predictions for them.
- tune_worker.py: what each `tune` worker runs and measures (peak memory, step time); torch is
  imported inside its functions, so `plan` never pays for it.
- tune.py: the `tune` command: the Ray Train job, the table, the config written.
"""
