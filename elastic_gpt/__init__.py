"""elastic-gpt: elastic, fault-tolerant GPT pretraining on Ray Train with FSDP2 (see README.md)."""
