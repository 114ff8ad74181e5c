"""Synthetic long-context retrieval ("pass key") data for the main job, and its retrieval accuracy.

Each document is a header, a repetitive filler text with a needle at a random depth, and a question::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. ...
    The grass is green. The sky is blue. ... The pass key is:48213. Remember it. The pass key is:48213. ...
    What is the pass key? The pass key is:

with the completion ``48213``. Made for copying by an induction head: the filler has no digits and no colon, so
``:`` is followed only by the key, the key's digits are distinct and are the only digits in the document.
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset

HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there. "
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is:"
KEY_DIGITS = 5


def passkey_example(rng: random.Random, num_chars: int) -> dict:
    """One document of about ``num_chars`` characters (= tokens): filler with a pass key hidden at a random depth.

    Returns ``{"prompt": header + filler with needle + question, "completion": "<key>"}``.
    """
    key = "".join(rng.sample("0123456789", KEY_DIGITS))  # distinct digits: copying each next digit is unambiguous
    needle = f"The pass key is:{key}. Remember it. The pass key is:{key}. "
    n_filler = max(1, (num_chars - len(HEADER) - len(needle) - len(QUESTION)) // len(FILLER))
    depth = rng.randint(0, n_filler)
    body = FILLER * depth + needle + FILLER * (n_filler - depth)
    return {"prompt": HEADER + body + QUESTION, "completion": key}


def passkey_dataset(num_examples: int, min_chars: int, max_chars: int, seed: int) -> Dataset:
    """``num_examples`` pass-key documents with lengths drawn uniformly from ``[min_chars, max_chars]``."""
    rng = random.Random(seed)
    rows = [passkey_example(rng, rng.randint(min_chars, max_chars)) for _ in range(num_examples)]
    return Dataset.from_list(rows)


@torch.no_grad()
def retrieval_accuracy(model, tokenizer, dataset: Dataset, max_examples: int | None = None) -> float:
    """Fraction of examples whose answer digits are all predicted exactly (teacher forced, argmax).

    One single-process forward per example with ``position_ids`` and no attention mask; ``model`` must be a plain
    (non sequence-parallel) causal LM.
    """
    was_training = model.training
    model.eval()
    n = len(dataset) if max_examples is None else min(max_examples, len(dataset))
    correct = 0
    device = next(model.parameters()).device
    for row in dataset.select(range(n)):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        ids = tokenizer(row["prompt"] + row["completion"])["input_ids"]
        input_ids = torch.tensor([ids], device=device)
        position_ids = torch.arange(len(ids), device=device)[None]
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
        # token t is predicted at position t - 1; score the digits of the completion (skip its leading space)
        targets = [t for t in range(len(prompt_ids), len(ids)) if tokenizer.convert_ids_to_tokens(ids[t]).isdigit()]
        pred = logits[[t - 1 for t in targets]].argmax(-1)
        correct += bool((pred == input_ids[0, targets]).all())
    model.train(was_training)
    return correct / max(n, 1)
