"""``python -m hf_sp_trainer.cli.tiny DIR``: a tiny random Llama (the main job's shipped config), the offline
tokenizer, and a small passkey jsonl dataset — what the CPU smoke variants of ``scripts/lora/`` train on."""

from __future__ import annotations

import sys
from pathlib import Path


def write_tiny_assets(out: str, num_examples: int = 16, min_chars: int = 256, max_chars: int = 1024) -> Path:
    from ..data import build_char_tokenizer
    from ..data.passkey import passkey_dataset
    from .main_job import build_model

    root = Path(out)
    build_model("sdpa").save_pretrained(root / "model")
    build_char_tokenizer().save_pretrained(root / "model")
    passkey_dataset(num_examples, min_chars, max_chars, seed=0).to_json(str(root / "data.jsonl"))
    return root


if __name__ == "__main__":
    print(write_tiny_assets(sys.argv[1]))
