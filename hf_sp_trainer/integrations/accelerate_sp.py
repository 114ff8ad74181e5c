"""accelerate's ways of asking for SP, routed to our Ulysses implementation.

accelerate maps ``ParallelismConfig(sp_size=N)`` (also built from the ``PARALLELISM_CONFIG_SP_*`` environment
variables that ``accelerate launch --parallelism_config_sp_size N`` sets) to DeepSpeed's ALST, which needs
DeepSpeed and a GPU. Here ``sp_size`` is taken out of that request and becomes ``args.sp_size``; what remains for
accelerate are the data-parallel dimensions, with the SP ranks folded into ``dp_shard`` so that FSDP2 shards the
parameters over them too (``dp_replicate x dp_shard x sp = world``, as in accelerate).

``route_accelerate_sp`` only computes the route (no side effect): the configs apply its ``sp_size`` and
``parallelism_config`` to themselves when they are built (``apply_to_args``), and the environment variables of an
environment request are rewritten at one entry point, right before the trainer builds its ``Accelerator`` (the only
reader of them): ``apply_environ`` in ``SequenceParallelMixin.create_accelerator_and_postprocess``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_FLAG, ENV_PREFIX = "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_"


@dataclass(frozen=True)
class AccelerateSPRoute:
    """Where an SP request of accelerate goes: ``sp_size`` and the ``parallelism_config`` left for accelerate (set on
    the config), and the environment variables to rewrite before the ``Accelerator`` is built (an environment
    request: accelerate builds its ``ParallelismConfig`` from them; SP is ours now)."""

    sp_size: int
    parallelism_config: Any
    environ: dict[str, str] = field(default_factory=dict)


def _env_int(environ: Mapping[str, str], name: str) -> int:
    return int(environ.get(ENV_PREFIX + name) or 1)


def route_accelerate_sp(args, environ: Mapping[str, str] | None = None) -> AccelerateSPRoute | None:
    """The route of an SP request in ``args.parallelism_config`` or the environment (``environ``, default
    ``os.environ``, only read), or ``None`` when accelerate asks for no SP. Raises a ``ValueError`` for a conflicting
    ``sp_size`` or tensor / context parallelism with SP. Changes nothing."""
    environ = os.environ if environ is None else environ
    config = args.parallelism_config
    from_env = config is None and environ.get(ENV_FLAG, "false").lower() == "true"
    if from_env:
        requested = _env_int(environ, "SP_SIZE")
        replicate, shard = _env_int(environ, "DP_REPLICATE_SIZE"), _env_int(environ, "DP_SHARD_SIZE")
        others = {"tp_size": _env_int(environ, "TP_SIZE"), "cp_size": _env_int(environ, "CP_SIZE")}
    elif config is not None:
        requested, replicate, shard = config.sp_size or 1, config.dp_replicate_size, config.dp_shard_size
        others = {"tp_size": config.tp_size, "cp_size": config.cp_size}
    else:
        return None
    if requested == 1:
        return None
    if args.sp_size not in (1, requested):
        raise ValueError(
            f"sp_size={args.sp_size} conflicts with accelerate's parallelism config sp_size={requested}: set one of "
            "them (or both to the same value)."
        )
    if any(size > 1 for size in others.values()):
        raise ValueError(
            f"Ulysses SP (sp_size={requested}) does not compose with tensor or context parallelism {others}; use "
            "tp_size=1 and cp_size=1."
        )
    if from_env:  # accelerate builds its ParallelismConfig from these variables: SP is ours now
        environ_update = {ENV_PREFIX + "SP_SIZE": "1", ENV_PREFIX + "DP_SHARD_SIZE": str(shard * requested)}
        if replicate * shard == 1:
            environ_update[ENV_FLAG] = "false"  # nothing left for accelerate's ParallelismConfig
        return AccelerateSPRoute(requested, None, environ_update)
    if replicate * shard == 1:  # plain data parallelism over SP groups (DDP, FSDP2 or ZeRO as configured)
        return AccelerateSPRoute(requested, None)
    from accelerate import ParallelismConfig

    return AccelerateSPRoute(requested, ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard * requested))


def apply_to_args(args, route: AccelerateSPRoute | None) -> None:
    """The config's own fields: ``sp_size`` and what is left of ``parallelism_config`` (when the config is built)."""
    if route is not None:
        args.sp_size, args.parallelism_config = route.sp_size, route.parallelism_config


def apply_environ(args) -> dict[str, str]:
    """The one place the route touches the process: rewrite accelerate's variables of an environment request, right
    before the ``Accelerator`` reads them (the trainer's accelerator creation). Returns what was set."""
    route = route_accelerate_sp(args) if hasattr(args, "sp_size") else None
    update = route.environ if route is not None else {}
    os.environ.update(update)
    return update
