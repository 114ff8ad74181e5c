"""``python -m hf_sp_trainer.cli.tiny DIR [--vlm]``: a tiny random Llama (the main job's shipped config), the offline
tokenizer, a small passkey jsonl dataset, and random-word preference pairs (``dpo.jsonl``) and prompts
(``prompts.jsonl``) — what the CPU smoke variants of the recipes in ``scripts/`` train on. ``--vlm``: a tiny LLaVA
with its processor (``DIR/vlm``) and vision conversations (``DIR/vision.parquet``) instead. Assets already complete in
``DIR`` (the same builder wrote them: it is deterministic) are kept, not rebuilt; a run whose assets were copied in
skips the ~6 CPU seconds of importing transformers to write them again."""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

TEXT_ASSETS = ("model/config.json", "model/model.safetensors", "model/tokenizer_config.json", "data.jsonl", "dpo.jsonl",
               "prompts.jsonl")  # fmt: skip
VLM_ASSETS = ("vlm/config.json", "vlm/model.safetensors", "vlm/processor_config.json", "vision.parquet")


def complete(out: str | Path, assets: tuple[str, ...]) -> bool:
    """Every one of ``assets`` (paths relative to ``out``) is there: written by an earlier run of this builder."""
    return all((Path(out) / name).exists() for name in assets)


def write_tiny_assets(out: str, num_examples: int = 16, min_chars: int = 256, max_chars: int = 1024) -> Path:
    from ..data import build_char_tokenizer
    from ..data.passkey import passkey_dataset
    from .main_job import build_model

    root = Path(out)
    build_model("sdpa").save_pretrained(root / "model")
    build_char_tokenizer().save_pretrained(root / "model")
    passkey_dataset(num_examples, min_chars, max_chars, seed=0).to_json(str(root / "data.jsonl"))
    write_word_rows(root / "dpo.jsonl", num_examples, (20, 60), chosen=3, rejected=2)
    write_word_rows(root / "prompts.jsonl", num_examples, (5, 20))
    return root


def write_word_rows(path: Path, n: int, prompt_words: tuple[int, int], **answers: int) -> None:
    """``n`` rows of a random-word ``prompt`` ending in `` ->``, plus each of ``answers`` (column -> word count)."""
    rng = random.Random(0)

    def words(k: int) -> str:
        return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6))) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            row = {"prompt": words(rng.randint(*prompt_words)) + " ->"}
            row |= {column: " " + words(count) for column, count in answers.items()}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    vlm = "--vlm" in sys.argv[2:]
    if complete(sys.argv[1], VLM_ASSETS if vlm else TEXT_ASSETS):
        print(Path(sys.argv[1]))
    elif vlm:
        from ..data.tiny_vlm import write_tiny_vlm_assets

        print(write_tiny_vlm_assets(sys.argv[1]))
    else:
        print(write_tiny_assets(sys.argv[1]))
