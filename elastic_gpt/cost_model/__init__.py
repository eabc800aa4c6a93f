"""The models of what a layout costs: bytes per device (memory.py) and time per step
(step_time.py), used by the planner to choose a layout and by the trainer to resolve the
settings a run leaves on `auto` (memory_settings.py), so both decide from the same figures."""
