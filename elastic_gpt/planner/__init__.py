"""Capacity planning: `elastic-gpt plan` (analytic model) and `elastic-gpt tune` (measurements)."""
