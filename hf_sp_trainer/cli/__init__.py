"""The ``hf-sp-sft`` command: ``trl sft`` plus sequence-parallel flags."""
