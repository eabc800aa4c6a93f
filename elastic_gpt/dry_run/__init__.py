"""`elastic-gpt dry-run`: the trainer's own code at full scale on one CPU, beside the plan.

- rank_step.py: one rank of a full-size run on torch's fake process group and fake tensors: the
  trainer's layout, mesh, model build, pipeline schedule, optimizer and one step; its peak memory
  by category and its collectives by mesh dimension.
- compare.py: that rank beside the planner's prediction for it.
- cli.py: the command: which ranks, the report, the exit code.
"""
