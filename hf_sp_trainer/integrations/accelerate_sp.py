"""accelerate's ways of asking for SP, routed to our Ulysses implementation.

accelerate maps ``ParallelismConfig(sp_size=N)`` (also built from the ``PARALLELISM_CONFIG_SP_*`` environment
variables that ``accelerate launch --parallelism_config_sp_size N`` sets) to DeepSpeed's ALST, which needs
DeepSpeed and a GPU. Here ``sp_size`` is taken out of that request and becomes ``args.sp_size``; what remains for
accelerate are the data-parallel dimensions, with the SP ranks folded into ``dp_shard`` so that FSDP2 shards the
parameters over them too (``dp_replicate x dp_shard x sp = world``, as in accelerate).
"""

from __future__ import annotations

import os

ENV_FLAG, ENV_PREFIX = "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_"


def _env_int(name: str) -> int:
    return int(os.environ.get(ENV_PREFIX + name) or 1)


def route_accelerate_sp(args) -> None:
    """Move an SP request from ``args.parallelism_config`` or the environment into ``args.sp_size``."""
    config = args.parallelism_config
    from_env = config is None and os.environ.get(ENV_FLAG, "false").lower() == "true"
    if from_env:
        requested, replicate, shard = _env_int("SP_SIZE"), _env_int("DP_REPLICATE_SIZE"), _env_int("DP_SHARD_SIZE")
        others = {"tp_size": _env_int("TP_SIZE"), "cp_size": _env_int("CP_SIZE")}
    elif config is not None:
        requested, replicate, shard = config.sp_size or 1, config.dp_replicate_size, config.dp_shard_size
        others = {"tp_size": config.tp_size, "cp_size": config.cp_size}
    else:
        return
    if requested == 1:
        return
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
    args.sp_size = requested
    if from_env:  # accelerate builds its ParallelismConfig from these variables: SP is ours now
        os.environ[ENV_PREFIX + "SP_SIZE"] = "1"
        os.environ[ENV_PREFIX + "DP_SHARD_SIZE"] = str(shard * requested)
        if replicate * shard == 1:
            os.environ[ENV_FLAG] = "false"  # nothing left for accelerate's ParallelismConfig
        return
    if replicate * shard == 1:
        args.parallelism_config = None  # plain data parallelism over SP groups (DDP, FSDP2 or ZeRO as configured)
        return
    from accelerate import ParallelismConfig

    args.parallelism_config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard * requested)
