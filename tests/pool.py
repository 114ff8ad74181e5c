"""Persistent gloo worlds for the test session (``harness.run_distributed``), as torch's ``MultiProcContinuousTest``
does it: each world size is spawned once, on first use, and serves every case sent to it.

A case is a picklable ``fn`` and its ``args``, sent to every rank over a pipe with a fresh ``MASTER_PORT``. Each rank
runs it exactly as a freshly spawned rank did (``fresh=True``): the distributed environment variables are set and no
process group exists yet (``fn``, or the Trainer it builds, creates the default group). After the case every rank
tears down and resets (``_end_case``) before it answers, so a world that answered is clean for the next case:

- process groups: the package's SP groups released, a barrier (only after a case that succeeded on this rank), then
  ``destroy_process_group`` -- one process group per case, on a fresh port, as before;
- accelerate's ``AcceleratorState`` / ``PartialState`` / ``GradientState`` singletons;
- DeepSpeed: transformers' HF-DeepSpeed config, ``deepspeed.comm``'s backend object, ``deepspeed.utils.groups``'
  cached groups (its ``_release_process_group_references``);
- torch: ``DeviceMesh``'s mesh stack, dynamo's caches and counters, default dtype, threads (1), deterministic
  algorithms, fp32 matmul precision and every backend's ``fp32_precision`` as a fresh process has them (setting the
  matmul precision to its own default turns mkldnn's from "none" to "ieee", which changed a compiled flex_attention
  eval by 5e-3 on an AMX CPU), grad mode, anomaly detection;
- transformers' attention / mask-attention registries (entries the case added or replaced), its log verbosity and
  ``warning_once`` memory, Python's warning filters;
- the package's ``functools`` caches (e.g. ``sp_topology``, which holds process groups);
- the package's module constants and the functions and classes its modules define, as imported (a case that sets
  ``gathered_keys.GATHER_ABOVE`` or wraps ``dsa._streamed_topk`` and doesn't undo it changed the kernels, and so
  the round-off, of every later case on that world): recorded as each module is imported (``PackageState``);
- the environment (every variable the case set, changed or removed) and the working directory;
- the random seeds (torch back to its fresh-process default seed; ``random`` / numpy seeded 0) -- set before each case.

What stays for the life of a world, as it always did across the cases of one ``run_cases`` call: imported modules,
and the package's idempotent swaps of transformers' kernel functions (``mixers``, the router loss).

Garbage collection: after each case's reset the rank's surviving objects (imported modules, above all) are moved to
Python's permanent generation (``gc.freeze``), so that the collections a case runs (the Trainer's ``free_memory``
collects at every ``train()``) scan only what the case made. A long-lived rank holds every module the cases imported;
a full collection over them took 0.28 s, a third of a tiny Trainer case's time.

Failure: a rank whose case raised answers ``("error", traceback)`` and exits at once (its peers' collectives then fail
fast instead of waiting on it); a rank that dies, or a case past its timeout, is reported as an error for that rank.
Any error kills the whole world; the next case of that size spawns a new one. ``shutdown`` (the session's end, or
``atexit``) stops every world: each rank leaves its loop with no process group alive and exits with ``os._exit(0)``
(no C++ static destructors, where gloo sometimes aborts a finished process).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.abc
import inspect
import os
import pickle
import random
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

STOP = b"stop"
ERROR_GRACE_S = 120  # after one rank failed, how long its peers get to fail or finish before the world is killed
TEARDOWN_BARRIER_S = 300 * float(os.environ.get("HF_SP_TEST_TIMEOUT_SCALE", "1"))  # see harness.TIMEOUT_SCALE
PORT_TAKEN = ("eaddrinuse", "address already in use")  # the free port went to another process before rank 0 took it
TORCH_DEFAULT_SEED = 67280421310721  # torch's CPU generator seed in a new process (c10's default_rng_seed_val)
spawned: list[int] = []  # world sizes spawned this session, in order (one entry per spawn, respawns included)
guard: Callable[[str], None] | None = None  # the conftest's check that no `unit` test uses the pool


def free_port() -> int:
    """A loopback port free now, from below the kernel's ephemeral range: the kernel never hands it to another
    process's outgoing connection or ``bind(0)`` (a gloo pair's listener) between this check and the caller's bind,
    and a client retrying a port nobody serves yet cannot reach such a listener (tiers run side by side)."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200) if low > 2048 else []:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a host whose ephemeral range starts low)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def dist_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )


def error_result(exc: BaseException) -> tuple[str, str]:
    return ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


# ----------------------------------------------------------------------------------------------------------------
# the parent side
# ----------------------------------------------------------------------------------------------------------------
class World:
    """``world_size`` spawned ranks, each serving cases from its pipe until told to stop."""

    def __init__(self, world_size: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):  # not daemonic: a case may start processes of its own
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=serve, args=(rank, world_size, child), name=f"pool{world_size}-{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        spawned.append(world_size)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(
        self, calls: list[tuple[Callable, tuple]], timeout: float, local: bool = False
    ) -> tuple[list[tuple[str, Any]], bool]:
        """Every rank's ``(status, value)`` for its call ``fn(*args)`` (``calls[rank]``), and whether the world is
        still usable; ``local``: the ranks run as independent single processes (no distributed environment)."""
        port = free_port()
        payloads = [pickle.dumps((fn, args, port, local)) for fn, args in calls]  # unpicklable: raised here
        for conn, payload in zip(self.conns, payloads, strict=True):
            conn.send_bytes(payload)
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables), timeout=left):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = self.conns[rank]
                if ready is not conn and not conn.poll():  # died without an answer
                    self.procs[rank].join(1)
                    results[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                    pending.discard(rank)
                    continue
                try:
                    results[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as exc:
                    results[rank] = ("error", f"rank {rank} died ({type(exc).__name__}, exit code "
                                              f"{self.procs[rank].exitcode})")  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle
                    results[rank] = error_result(exc)
                pending.discard(rank)
                if results[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        for rank in pending:
            results[rank] = ("error", f"rank {rank} died or hung (no answer within the case's timeout of {timeout} s)")
        ordered = [results[r] for r in range(self.world_size)]
        healthy = not pending and all(s == "ok" for s, _ in ordered) and self.alive()
        return ordered, healthy

    def stop(self, timeout: float = 30) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(STOP)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(10)
        for conn in self.conns:
            conn.close()


_WORLDS: dict[int, World] = {}


def run(
    world_size: int, fn: Callable, args: tuple, timeout: float, per_rank: list[tuple] | None = None, local: bool = False
) -> list[tuple[str, Any]]:
    """``fn(*args)`` on every rank of the session's ``world_size`` world (spawned now if there is none, or if the
    last one failed), or ``fn(*per_rank[rank])``; each rank's ``(status, value)``. ``local``: without the
    distributed environment (independent single processes, e.g. references computed side by side)."""
    if guard is not None:
        guard(f"the {world_size}-rank gloo pool")
    world = _WORLDS.get(world_size)
    if world is not None and not world.alive():
        world.kill()
        world = None
    if world is None:
        world = _WORLDS[world_size] = World(world_size)
    calls = [(fn, per_rank[r] if per_rank is not None else args) for r in range(world_size)]
    for attempt in range(2):
        results, healthy = world.run(calls, timeout, local)
        if not healthy:  # a failed or hung case: nothing of it may reach the next case
            del _WORLDS[world_size]
            world.kill()
        errors = " ".join(str(v).lower() for status, v in results if status == "error")
        if healthy or attempt or not any(text in errors for text in PORT_TAKEN):
            return results
        world = _WORLDS[world_size] = World(world_size)  # another process took the free port first: once more
    return results


def shutdown() -> None:
    """Stop every world (idempotent): the session's end."""
    while _WORLDS:
        _, world = _WORLDS.popitem()
        world.stop()


atexit.register(shutdown)


# ----------------------------------------------------------------------------------------------------------------
# the rank side
# ----------------------------------------------------------------------------------------------------------------
def serve(rank: int, world_size: int, conn) -> None:
    """A rank's loop: receive a case, run it, tear down and reset, answer; until ``STOP`` or the parent is gone."""
    import torch

    os.environ.update(dist_env(rank, world_size, 0))
    torch.set_num_threads(1)
    baseline = Baseline()
    gc.freeze()
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if message == STOP:
            break
        try:
            fn, args, port, local = pickle.loads(message)
            os.environ["MASTER_PORT"] = str(port)
            if local:  # one process on its own: what the pytest process is (no rank, no world)
                for key in dist_env(rank, world_size, port):
                    if key != "OMP_NUM_THREADS":
                        del os.environ[key]
            baseline.seed()
            result = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
            result = error_result(exc)
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            result = error_result(exc)
            data = pickle.dumps(result)
        usable = result[0] == "ok" and _end_case(baseline)
        _flush()  # the case's prints reach the test that ran it (a fresh process flushed them at its exit)
        conn.send_bytes(data)
        if not usable:  # a failed case: leave now (peers in a collective with this rank fail instead of waiting)
            break
    _exit()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit() -> None:
    _flush()
    os._exit(0)


def _end_case(baseline: Baseline) -> bool:
    """Tear down what the case left (process groups first) and reset the process to ``baseline``; False if the
    world is no longer usable (a peer gone, a reset that failed)."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=TEARDOWN_BARRIER_S))
            _release_package_groups()
            dist.destroy_process_group()
        baseline.restore()
        return True
    except Exception:  # noqa: BLE001 - the parent sees the world die and respawns it
        traceback.print_exc()
        return False


def _package_modules() -> list:
    return [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "hf_sp_trainer" and m is not None]


def _release_package_groups() -> None:
    """The package's own SP / Ulysses / ring groups (``release_groups``, wherever the package keeps it), destroyed
    before the default group."""
    done = set()
    for module in _package_modules():
        release = getattr(module, "release_groups", None)
        if callable(release) and id(release) not in done:
            done.add(id(release))
            release()


class Baseline:
    """The rank's state before its first case, and the resets back to it."""

    def __init__(self) -> None:
        import torch

        self.package = PackageState()
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.fp32_precisions = {path: _backend(path).fp32_precision for path in FP32_PRECISIONS}
        self.warning_filters = list(warnings.filters)
        self.registries = {id(r): (r, dict(r._global_mapping)) for r in _registries()}
        self.verbosity = _transformers_verbosity()

    def seed(self) -> None:
        import torch

        torch.manual_seed(TORCH_DEFAULT_SEED)
        random.seed(0)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(0)

    def restore(self) -> None:
        import torch

        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        for path, value in self.fp32_precisions.items():  # what the call above sets, as a fresh process has it
            _backend(path).fp32_precision = value
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        warnings.filters[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # forget what "once" filters have shown
        self._reset_libraries()
        self.package.restore()
        for cache in _package_caches():
            cache.cache_clear()
        gc.collect()
        gc.freeze()  # what survived the case: kept out of the next case's collections

    def _reset_libraries(self) -> None:
        for registry in _registries():  # entries the case registered (the SP attention) or replaced
            original = self.registries.get(id(registry), (registry, {}))[1]
            registry._global_mapping.clear()
            registry._global_mapping.update(original)
        if "accelerate.state" in sys.modules:
            state = sys.modules["accelerate.state"]
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()
        if "transformers.integrations.deepspeed" in sys.modules:
            sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()
        if "vllm.distributed.parallel_state" in sys.modules:  # a colocated engine's groups died with the world
            state = sys.modules["vllm.distributed.parallel_state"]
            for name, value in vars(state).items():
                if name.isupper() and name.startswith("_") and (value is None or hasattr(value, "device_group")):
                    setattr(state, name, None)
            state._NODE_COUNT = None
        if "deepspeed.comm.comm" in sys.modules:
            sys.modules["deepspeed.comm.comm"].cdb = None  # its backend object wraps the destroyed group
        if "deepspeed.utils.groups" in sys.modules:
            groups = sys.modules["deepspeed.utils.groups"]
            release = getattr(groups, "_release_process_group_references", None)
            if release is not None:  # DeepSpeed's own reset of its group caches after the world's teardown
                release(None)
            else:
                for name, value in vars(groups).items():
                    if name.isupper() and name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
                        if isinstance(value, dict):
                            value.clear()
                        else:
                            setattr(groups, name, None)
                    elif name.startswith("_MPU_"):
                        setattr(groups, name, None)
                groups.mpu = groups.mesh_device = None
                groups.expert_tensor_parallel_world_size = 1
        if "torch.distributed.device_mesh" in sys.modules:
            resources = getattr(sys.modules["torch.distributed.device_mesh"], "_mesh_resources", None)
            if resources is not None and hasattr(resources, "mesh_stack"):
                resources.mesh_stack.clear()
        if "torch._dynamo" in sys.modules:
            dynamo = sys.modules["torch._dynamo"]
            dynamo.reset()
            dynamo.utils.counters.clear()
        if "transformers.utils.logging" in sys.modules:
            logging = sys.modules["transformers.utils.logging"]
            if self.verbosity is not None:
                logging.set_verbosity(self.verbosity)
            import logging as std_logging

            for name in ("warning_once", "info_once"):
                cached = getattr(std_logging.Logger, name, None)
                if hasattr(cached, "cache_clear"):
                    cached.cache_clear()


# torch's fp32 precision settings (setting the matmul precision, even to its default "highest", turns mkldnn's
# matmul from "none" to "ieee", and inductor's flex_attention on an AMX CPU then computes another result: 5e-3 apart)
FP32_PRECISIONS = ("backends", "backends.mkldnn", "backends.mkldnn.matmul", "backends.mkldnn.conv",
                   "backends.mkldnn.rnn", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv",
                   "backends.cudnn.rnn")  # fmt: skip


def _backend(path: str):
    import torch

    obj = torch
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class PackageState(importlib.abc.MetaPathFinder):
    """Each module of the package as imported: its constants (upper-case names) and the functions and classes it
    defines, name -> value, per module (``modules``). The modules imported already are read now; every later one
    right after its import (this finder wraps its loader's ``exec_module``), so what a case changes in a module it
    imported itself is known too."""

    def __init__(self) -> None:
        self.modules: dict[str, dict[str, Any]] = {m.__name__: _module_state(m) for m in _package_modules()}
        sys.meta_path.insert(0, self)

    def find_spec(self, name: str, path, target=None):
        if name.split(".")[0] != "hf_sp_trainer":
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module) -> None:
                run(module)
                self.modules[module.__name__] = _module_state(module)

            spec.loader.exec_module = exec_module  # this module's own loader object
        return spec

    def restore(self) -> list[str]:
        """Put back what a case rebound of the recorded names; the names put back."""
        restored = []
        for module_name, names in self.modules.items():
            module = sys.modules.get(module_name)
            for name, value in names.items() if module is not None else ():
                if vars(module).get(name, restored) is not value:
                    setattr(module, name, value)
                    restored.append(f"{module_name}.{name}")
        return restored


def _module_state(module) -> dict[str, Any]:
    def kept(name: str, value) -> bool:
        if name.strip("_").isupper():
            return True
        return (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__

    return {k: v for k, v in vars(module).items() if kept(k, v)}


def _registries() -> list:
    """transformers' global attention-function registries (imported here once, before the first case)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return [ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS]


def _transformers_verbosity() -> int | None:
    from transformers.utils import logging

    return logging.get_verbosity()


def _package_caches() -> list:
    """Every ``functools`` cache of the package's modules (pure, except ``sp_topology``'s process groups)."""
    caches = {}
    for module in _package_modules():
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", "").startswith(
                "hf_sp_trainer"
            ):
                caches[id(value)] = value
    return list(caches.values())
