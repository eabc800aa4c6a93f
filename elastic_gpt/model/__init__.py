"""The GPT model alone: no Ray, no FSDP, no config files (config.py: the shape, presets,
parameter and FLOP counts, importing no torch; gpt.py: the modules, init and loss)."""
