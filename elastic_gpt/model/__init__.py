"""The GPT model alone: no Ray, no FSDP, no config files (gpt.py: modules, presets, FLOPs)."""
