"""Training health: what goes wrong in a run without stopping it, found and handled without a
person. The Trainer holds one `monitor.TrainingHealth` and calls it twice a step.

- spikes.py: the loss spike detector (running median and MAD).
- recovery.py: a spike rolled back, attributed by re-running, its data skipped; budgets.
- attribution.py: each rank's exact checksums of its work, and the rank whose work differs first.
- silent_corruption.py: HSDP's replicas and the replica groups' copies compared; healed.
- stragglers.py: every rank's compute timed, and a known answer checked; slow or wrong evicted.
- faults.py: where a test's injected hardware faults act (none in a run).
- monitor.py: `TrainingHealth`, the one object over all of them.

It imports no Ray and nothing of the trainer: what it acts through comes in.
"""
