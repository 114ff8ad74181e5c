"""Synthetic long-context retrieval ("pass key") data for the main job.

A document is one line of character-level text (one token per character with ``build_char_tokenizer``)::

    <filler> key #C7Q. <filler> ... <filler> key? #        -> completion "C7Q"

- the **filler** is made of random lowercase "words" (a fresh random lexicon per document), spaces and periods;
- the **needle** `` key #C7Q. `` sits at a random depth; the **question** `` key? #`` ends the prompt;
- the **key** has one character per slot, each slot with its own alphabet (``KEY_ALPHABETS``: a letter A-M,
  a digit, a letter N-Z) that appears nowhere else in the document, so the answer is unambiguous and can only be read
  from the needle: a model that cannot attend to the needle is at chance (1 / 1690 for the full key).

With ``sp_size`` ranks a sequence is split into ``sp_size`` contiguous shards; the question (and the answer) are in
the last shard, so the needle is *cross-shard* when it lies in an earlier shard. :func:`passkey_eval_dataset` makes
held-out documents balanced between cross-shard and in-shard needles; ``hf_sp_trainer.cli.main_job.sp_retrieval``
scores them through the SP model, and with attention restricted to each shard (the control).

Lengths are counted in tokens of the training sequence: ``len(prompt) + len(completion) + 1`` (the EOS that TRL
appends to the completion) ``== num_chars`` with the character tokenizer.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Sequence

from datasets import Dataset

KEY_ALPHABETS = ("ABCDEFGHIJKLM", "0123456789", "NOPQRSTUVWXYZ")
MARKER = "#"
NEEDLE = " key " + MARKER + "{key}. "
QUESTION = " key? " + MARKER
WORD_CHARS = string.ascii_lowercase
ENGLISH = "the grass is green. the sky is blue. the sun is yellow. here we go. there and back again. "


def _filler(rng: random.Random, num_chars: int, kind: str) -> str:
    if kind == "words":  # a fresh lexicon of random words per document
        lexicon = ["".join(rng.choices(WORD_CHARS, k=rng.randint(2, 7))) for _ in range(rng.randint(20, 60))]
        out, n = [], 0
        while n < num_chars:
            word = rng.choice(lexicon) + (". " if rng.random() < 0.1 else " ")
            out.append(word)
            n += len(word)
        return "".join(out)[:num_chars]
    if kind == "random":  # i.i.d. characters
        return "".join(rng.choices(WORD_CHARS + "    ", k=num_chars))
    if kind == "english":  # the classic repeated sentences
        return (ENGLISH * (num_chars // len(ENGLISH) + 1))[:num_chars]
    raise ValueError(f"unknown filler kind {kind!r}")


def min_chars(key_alphabets: Sequence[str] = KEY_ALPHABETS) -> int:
    """The shortest document :func:`passkey_example` can make (a few filler characters)."""
    key = "x" * len(key_alphabets)
    return len(NEEDLE.format(key=key)) + len(QUESTION) + len(key) + 1 + 4


def passkey_example(
    rng: random.Random,
    num_chars: int,
    depth: float | None = None,
    filler: str = "words",
    key_alphabets: Sequence[str] = KEY_ALPHABETS,
) -> dict:
    """One document of ``num_chars`` tokens (EOS included) with the needle at relative ``depth`` (random if None).

    Returns ``{"prompt", "completion", "needle_start", "needle_end"}``; the needle is
    ``prompt[needle_start:needle_end]``.
    """
    key = "".join(rng.choice(alphabet) for alphabet in key_alphabets)
    needle = NEEDLE.format(key=key)
    n_filler = num_chars - len(needle) - len(QUESTION) - len(key) - 1
    if n_filler < 1:
        raise ValueError(f"num_chars={num_chars} is too short, need at least {min_chars(key_alphabets)}")
    text = _filler(rng, n_filler, filler)
    cut = round((rng.random() if depth is None else depth) * n_filler)
    cut = max(0, min(n_filler, cut))
    return {
        "prompt": text[:cut] + needle + text[cut:] + QUESTION,
        "completion": key,
        "needle_start": cut,
        "needle_end": cut + len(needle),
    }


def passkey_dataset(
    num_examples: int, min_chars: int, max_chars: int, seed: int, log_uniform: bool = False, **kwargs
) -> Dataset:
    """``num_examples`` documents with lengths drawn uniformly (or log-uniformly) from ``[min_chars, max_chars]``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        if log_uniform:
            length = round(math.exp(rng.uniform(math.log(min_chars), math.log(max_chars))))
        else:
            length = rng.randint(min_chars, max_chars)
        rows.append(passkey_example(rng, length, **kwargs))
    return Dataset.from_list(rows)


def passkey_curriculum_dataset(
    seed: int,
    batch_size: int = 32,
    short_batches: int = 300,
    long_batches: int = 150,
    short_chars: tuple[int, int] = (32, 128),
    long_chars: tuple[int, int] = (1024, 8192),
    **kwargs,
) -> Dataset:
    """The main job's training documents, **in training order** (use ``train_sampling_strategy="sequential"`` and
    ``per_device_train_batch_size=batch_size`` with one data-parallel group, e.g. 2 processes at ``sp_size`` 2).

    Batch ``k`` is rows ``k * batch_size .. (k + 1) * batch_size - 1``:

    - ``short_batches`` batches of short documents (lengths log-uniform in ``short_chars``): the retrieval circuit
      forms on them (a needle is ~1/80 of the context, so the gradient signal is strong), cheaply;
    - ``long_batches`` batches of one long document (uniform in ``long_chars``) plus ``batch_size - 1`` short ones:
      the long documents teach retrieval over the full length at the cost of one long document per step.
    """
    rng = random.Random(seed)

    def short():
        lo, hi = short_chars
        return passkey_example(rng, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))), **kwargs)

    rows = [short() for _ in range(short_batches * batch_size)]
    for _ in range(long_batches):
        batch = [passkey_example(rng, rng.randint(*long_chars), **kwargs)] + [short() for _ in range(batch_size - 1)]
        rng.shuffle(batch)
        rows.extend(batch)
    return Dataset.from_list(rows)


def tokenize_completions(dataset: Dataset, tokenizer) -> Dataset:
    """``input_ids`` (prompt + completion + EOS) and ``labels`` (``-100`` on the prompt), what TRL builds from a
    prompt/completion dataset with ``completion_only_loss``, in one batched tokenizer call: TRL then trains on it as
    given (a dataset with ``input_ids`` and ``labels`` is left as is)."""
    prompts = tokenizer(list(dataset["prompt"]), add_special_tokens=False)["input_ids"]
    completions = tokenizer(list(dataset["completion"]), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    input_ids = [p + c + eos for p, c in zip(prompts, completions, strict=True)]
    labels = [[-100] * len(p) + c + eos for p, c in zip(prompts, completions, strict=True)]
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels})


def shard_bounds(num_tokens: int, sp_size: int) -> list[tuple[int, int]]:
    """The contiguous ``[start, end)`` token ranges of the ``sp_size`` shards of a sequence (Ulysses layout: the
    sequence is padded to a multiple of ``sp_size``, each rank holds one equal slice; the padding is in the last)."""
    size = -(-num_tokens // sp_size)
    return [(min(r * size, num_tokens), min((r + 1) * size, num_tokens)) for r in range(sp_size)]


def shard_of(position: int, num_tokens: int, sp_size: int) -> int:
    return position // -(-num_tokens // sp_size)


def passkey_eval_dataset(
    num_per_length: int,
    lengths: Sequence[int],
    seed: int,
    sp_size: int = 2,
    cross_shard_fraction: float = 0.5,
    **kwargs,
) -> Dataset:
    """Held-out documents, ``num_per_length`` of each length; in each length group a ``cross_shard_fraction`` share
    has the needle inside shards ``0 .. sp_size-2`` (not the question's shard), the rest inside the last shard.

    Depths are random within those ranges, away from the shard boundaries.
    """
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        n_cross = round(num_per_length * cross_shard_fraction)
        for i in range(num_per_length):
            cross = i < n_cross
            # needle start as a fraction of the filler: cross-shard in [0, (P-1)/P), in-shard in [(P-1)/P, 1)
            boundary = (sp_size - 1) / sp_size
            for _ in range(100):
                depth = rng.uniform(0.0, boundary) if cross else rng.uniform(boundary, 1.0)
                row = passkey_example(rng, length, depth=depth, **kwargs)
                n_tokens = len(row["prompt"]) + len(row["completion"]) + 1
                first, last = (
                    shard_of(row["needle_start"], n_tokens, sp_size),
                    shard_of(row["needle_end"] - 1, n_tokens, sp_size),
                )
                if first == last and (last < sp_size - 1) == cross:
                    break
            else:
                raise ValueError(f"could not place a needle in length {length} (sp_size={sp_size})")
            row["length"] = length
            rows.append(row)
    return Dataset.from_list(rows)


def encode_example(tokenizer, row: dict, sp_size: int = 2) -> dict:
    """Token ids of ``prompt + completion`` (+ EOS, as TRL trains), the answer positions to score (the completion's
    tokens, EOS excluded), the needle's token span, and whether the needle is in another shard than the answer."""
    text = row["prompt"] + row["completion"]
    enc = tokenizer(text, add_special_tokens=False)
    ids = list(enc["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    first_answer = enc.char_to_token(len(row["prompt"]))
    answer = list(range(first_answer, len(enc["input_ids"])))
    needle = (enc.char_to_token(row["needle_start"]), enc.char_to_token(row["needle_end"] - 1) + 1)
    n = len(ids)
    answer_shards = {shard_of(t - 1, n, sp_size) for t in answer} | {shard_of(t, n, sp_size) for t in answer}
    needle_shards = {shard_of(t, n, sp_size) for t in range(*needle)}
    return {
        "input_ids": ids,
        "answer_positions": answer,
        "needle_span": needle,
        "cross_shard": not (needle_shards & answer_shards),
        "num_tokens": n,
    }
