"""The models of what a layout costs: bytes per device (memory.py) and time per step
(step_time.py), used by the planner to choose a layout and by the trainer to resolve the
settings a run leaves on `auto` (memory_settings.py), so both decide from the same figures.

What depends on the software running the step (its kernels, tensor and data parallelism,
pipeline cuts) is asked of a `Software` (software.py); this trainer's (trainer_software.py) is
the only one here. Imports no torch: the planner runs without it.
"""
