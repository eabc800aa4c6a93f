"""How the model is spread over devices: the named mesh (data and tensor parallel degrees),
tensor and sequence parallelism, FSDP2 sharding (HSDP across nodes), mixed precision,
activation checkpointing and compile. Knows the model and torch.distributed, never Ray."""
