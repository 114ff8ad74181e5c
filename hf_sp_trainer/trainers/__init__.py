"""The trainer step: ``SPTrainer`` (``base``) and the TRL trainers built on it (``sft``, ``dpo``, ``kto``, ``reward``,
``grpo``), their arguments (``arguments``), and the log-prob scoring over shards that the preference and RL trainers
share (``scoring``)."""
