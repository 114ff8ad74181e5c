"""Log-probabilities and rewards over shards, shared by the preference trainers (DPO, reward, KTO) and the RL ones
(GRPO, RLOO): packed layouts (``layout``), the hooks that score a shard (``hooks``) and the trainer mixin (``mixin``).
Sequence-level terms are summed over the SP group with ``comm.sequence_all_reduce``."""
