"""TRL's vLLM server mode under SP (docs/grpo.md, "vLLM rollouts"): one server generates for every SP group.

TRL's main process talks to the server (``trl vllm-serve``: vLLM's OpenAI server in development mode) through a
``VLLMClient``. Two things are ours:

- **the SP groups' rows, sent once** (``served_requests``): TRL gathers every process's prompts and hands each
  process its own slice, so the ranks of an SP group would get different completions of the same prompts. While
  ``served_requests`` is active, every rank contributes its rows and their seeds with its group's first rank; the
  main process sends each group's rows once, one request per row with the row's own seed (the same seeds as colocated
  ``split`` generation, ``rollouts.request_seeds``: the same completions whichever process draws them), and every rank
  of the group gets the group's completions.
- **a weight sync without NCCL** (``weight_files``): vLLM's weight-transfer engines are GPU transports. With
  ``vllm_server_weight_sync="files"`` the gathered weights are written as safetensors (in the checkpoint layout,
  ``rollouts.checkpoint_format``) to a directory trainer and
  server both see (a fresh subdirectory per sync, renamed into place once complete) and the server reloads them
  (``POST /collective_rpc`` ``reload_weights``, one of vLLM's development endpoints). ``"nccl"`` keeps TRL's own
  path (CUDA).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

WEIGHT_SYNCS = ("auto", "nccl", "files")
SHARD_BYTES = 2 << 30  # safetensors files of at most ~2 GiB each

# What the next server client TRL builds in this process gets: the directory weights are written to ("files"), or None
_SERVER_OPTIONS: list[str | None] = []


def resolve_weight_sync(weight_sync: str) -> str:
    """``"auto"``: TRL's NCCL transfer where the trainer has CUDA, files elsewhere."""
    if weight_sync not in WEIGHT_SYNCS:
        raise ValueError(f"vllm_server_weight_sync={weight_sync!r}: use one of {WEIGHT_SYNCS}.")
    if weight_sync == "auto":
        return "nccl" if torch.cuda.is_available() else "files"
    return weight_sync


@contextlib.contextmanager
def weight_files(directory: str | None) -> Iterator[None]:
    """While TRL builds its server client: sync weights through ``directory`` (None: TRL's NCCL transfer)."""
    _SERVER_OPTIONS.append(directory)
    try:
        yield
    finally:
        _SERVER_OPTIONS.pop()


def _main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _from_main(work: Callable[[], Any]) -> Any:
    """``work()`` on the main process, its result on every rank; its error raised on every rank, so that none waits
    in a later collective."""
    result, error = None, None
    if _main():
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank
            error = e
    box = [result, None if error is None else f"{type(error).__name__}: {error}"]
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise RuntimeError(f"vLLM server (main process): {box[1]}")
    return box[0]


def init_client(original):
    """``VLLMGeneration._init_vllm``: in server mode with a weight directory, the client without TRL's NCCL
    communicator, the server's development endpoints checked; a failure raised on every rank."""

    def _init_vllm(self):
        directory = _SERVER_OPTIONS[-1] if _SERVER_OPTIONS else None
        if self.mode != "server" or directory is None:
            return original(self)
        self._sp_weight_dir = directory
        self._sp_weight_syncs = 0

        def connect() -> None:
            from trl.generation.vllm_client import VLLMClient

            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = VLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
            )
            self.vllm_client.get_server_info()  # raises unless the server runs in development mode

        _from_main(connect)

    return _init_vllm


def sync_through_files(generation) -> None:
    """Every rank walks the parameters (gathering is collective under ZeRO-3 / FSDP); the main process writes them to
    a fresh subdirectory of the weight directory (renamed into place when complete), the server reloads it, and the
    previous one is removed."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in generation._iter_named_params():
        if _main():
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def write_and_reload() -> None:
        from .rollouts import checkpoint_format

        generation._sp_weight_syncs += 1
        path = _write(
            checkpoint_format(generation.model, tensors), generation._sp_weight_dir, generation._sp_weight_syncs
        )
        client = generation.vllm_client
        response = client.session.post(
            f"{client.base_url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}}
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"the server at {client.base_url} did not reload {path}: {response.status_code} {response.text}. "
                "Start it with VLLM_SERVER_DEV_MODE=1 (trl vllm-serve sets it) and give it the same path."
            )
        client.reset_prefix_cache()
        previous = os.path.join(generation._sp_weight_dir, f"sync-{generation._sp_weight_syncs - 1:06d}")
        shutil.rmtree(previous, ignore_errors=True)

    _from_main(write_and_reload)


def _write(tensors: dict[str, torch.Tensor], directory: str, number: int) -> str:
    from safetensors.torch import save_file

    final = os.path.abspath(os.path.join(directory, f"sync-{number:06d}"))
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    for name, tensor in tensors.items():
        shard[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            save_file(shard, os.path.join(partial, f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard or index == 0:
        save_file(shard, os.path.join(partial, f"model-{index:05d}.safetensors"))
    os.replace(partial, final)
    return final


@dataclass
class Rows:
    """A rank's rows for the server: their seeds and the first rank of its SP group (whose rows stand for it)."""

    seeds: list[int]
    leader: int


@contextlib.contextmanager
def served_requests(generation, seeds: list[int], leader: int) -> Iterator[None]:
    """Within: ``generation.generate`` (server mode) sends each SP group's rows once, each with its seed."""
    generation._sp_rows = Rows(list(seeds), leader)
    try:
        yield
    finally:
        generation._sp_rows = None


def generate_served(original):
    """``VLLMGeneration.generate``: while ``served_requests`` is active, each SP group's rows sent once (above)."""

    def generate(self, prompts, images, num_generations, profiler=None):
        rows: Rows | None = getattr(self, "_sp_rows", None)
        if self.mode != "server" or rows is None:
            return original(self, prompts, images, num_generations, profiler)
        if images is not None and any(i is not None for i in images):
            raise ValueError("served_requests: prompts with images go through TRL's own server path.")
        if len(rows.seeds) != len(prompts):
            raise RuntimeError(f"served_requests: {len(rows.seeds)} seeds for {len(prompts)} prompts.")
        mine = (rows.leader, list(prompts), rows.seeds)
        everyone = [mine]
        if _distributed():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)

        def draw() -> dict:
            groups = {leader: (p, s) for rank, (leader, p, s) in enumerate(everyone) if rank == leader}
            with profiler or contextlib.nullcontext():
                return {leader: _draw(self, p, s) for leader, (p, s) in groups.items()}

        return _from_main(draw)[rows.leader]

    return generate


def _draw(generation, prompts: list[list[int]], seeds: list[int]) -> tuple[list, list, list, list | None]:
    """One request per row (``n=1``, the row's seed), sent concurrently (the server batches them); TRL's sampling
    parameters. Returns TRL's ``generate`` tuple: prompt ids, completion ids, log-probs, their token ids."""
    params: dict[str, Any] = {
        "n": 1,
        "repetition_penalty": generation.repetition_penalty,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "top_k": generation.top_k,
        "min_p": 0.0 if generation.min_p is None else generation.min_p,
        "max_tokens": generation.max_completion_length,
        "logprobs": generation.logprobs,
        "structured_outputs_regex": generation.structured_outputs_regex,
    }
    client = generation.vllm_client

    def send(row: int) -> dict:
        extra = {**generation.generation_kwargs, "seed": seeds[row]}
        return client.generate(prompts=[prompts[row]], generation_kwargs=extra, **params)

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(prompts)))) as pool:
        outs = list(pool.map(send, range(len(prompts))))
    token_ids = [o.get("logprob_token_ids") for o in outs]
    return (
        [o["prompt_ids"][0] for o in outs],
        [o["completion_ids"][0] for o in outs],
        None if any(o["logprobs"] is None for o in outs) else [o["logprobs"][0] for o in outs],
        None if any(t is None for t in token_ids) else [t[0] for t in token_ids],
    )


def sync_weights_through_files(generation) -> bool:
    """Whether ``generation`` (TRL's ``VLLMGeneration``) syncs its server through a weight directory."""
    return generation.mode == "server" and getattr(generation, "_sp_weight_dir", None) is not None
