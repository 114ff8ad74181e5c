"""Losses under sequence parallelism: the token loss of a micro-batch from its shards (``sequence``), the MoE router's
load-balancing loss as shares of the whole sequence's (``router``), and the fused linear cross-entropy that never
materialises the logits (``fused``)."""
