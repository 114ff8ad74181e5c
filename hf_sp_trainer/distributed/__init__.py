"""Distributed backends: how SP composes with DDP, FSDP2 and DeepSpeed ZeRO, and accelerate's ways of asking for SP."""
