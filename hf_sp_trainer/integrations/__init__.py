"""Host integration: how SP composes with DDP, FSDP2 and DeepSpeed ZeRO on CPU-only machines (``cpu_backend``),
accelerate's ways of asking for SP (``accelerate_sp``), the throughput callback (``throughput``), and DeepSpeed's
universal checkpoints for resuming ZeRO on another world size (``ds_universal``)."""
