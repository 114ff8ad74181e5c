"""Distributed setup: how SP composes with DDP, FSDP2 and DeepSpeed ZeRO (on CPU-only machines too), accelerate's ways
of asking for SP, and tearing the process groups down."""
