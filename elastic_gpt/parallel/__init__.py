"""How the model is spread over devices: FSDP2 sharding, mixed precision, activation
checkpointing and compile. Knows the model and torch.distributed, never Ray."""
