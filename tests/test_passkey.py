"""The main job's data: documents of the asked length, keys readable only from the needle, held-out documents split
evenly between cross-shard and in-shard needles, the curriculum's batch order, TRL-style completion labels."""

import pytest

from hf_sp_trainer.data import build_char_tokenizer
from hf_sp_trainer.data.passkey import (
    KEY_ALPHABETS,
    encode_example,
    passkey_curriculum_dataset,
    passkey_eval_dataset,
    tokenize_completions,
)

pytestmark = pytest.mark.unit  # in-process


def test_eval_documents_half_cross_shard_at_every_length():
    tokenizer = build_char_tokenizer()
    lengths = (512, 2048)
    evals = passkey_eval_dataset(6, lengths, seed=3, sp_size=2)
    for length in lengths:
        rows = [row for row in evals if row["length"] == length]
        encoded = [encode_example(tokenizer, row, sp_size=2) for row in rows]
        assert all(ex["num_tokens"] == length for ex in encoded)
        assert sum(ex["cross_shard"] for ex in encoded) == 3
        for row, ex in zip(rows, encoded, strict=True):
            start, end = ex["needle_span"]
            assert ex["cross_shard"] == (end - 1 < length // 2)  # the question is in the last shard
            assert [ex["input_ids"][t] for t in ex["answer_positions"]] == tokenizer.convert_tokens_to_ids(
                list(row["completion"])
            )


def test_key_characters_appear_only_in_the_needle():
    for row in passkey_eval_dataset(4, (256,), seed=0):
        key, prompt = row["completion"], row["prompt"]
        needle = prompt[row["needle_start"] : row["needle_end"]]
        assert key in needle and len(key) == len(KEY_ALPHABETS)
        outside = prompt[: row["needle_start"]] + prompt[row["needle_end"] :]
        assert not set(outside) & set("".join(KEY_ALPHABETS))


def test_curriculum_order_and_completion_labels():
    docs = passkey_curriculum_dataset(0, batch_size=4, short_batches=2, long_batches=2, long_chars=(600, 700))
    lengths = [len(p) + len(c) + 1 for p, c in zip(docs["prompt"], docs["completion"], strict=True)]
    assert all(n <= 128 for n in lengths[:8])  # short batches first
    for k in (2, 3):  # then one long document per batch
        assert sum(n >= 600 for n in lengths[4 * k : 4 * k + 4]) == 1
    tokenizer = build_char_tokenizer()
    train = tokenize_completions(docs, tokenizer)
    for row, doc in zip(train, docs, strict=True):
        prompt_len = len(doc["prompt"])
        assert len(row["input_ids"]) == len(row["labels"]) == prompt_len + len(doc["completion"]) + 1
        assert set(row["labels"][:prompt_len]) == {-100}
        assert row["labels"][prompt_len:] == row["input_ids"][prompt_len:]
        assert row["input_ids"][-1] == tokenizer.eos_token_id
