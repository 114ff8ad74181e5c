"""accelerate's ways of asking for SP are routed to ``sp_size`` (the distributed runs are in test_distributed.py and
test_cli.py); conflicting or unsupported requests raise clear errors in ``TrainingArguments``, before any process
group exists. Building the config changes no environment variable: an environment request is rewritten only when
the trainer builds its Accelerator (``apply_environ``)."""

import os

import pytest
from accelerate import ParallelismConfig

from hf_sp_trainer import TrainingArguments
from hf_sp_trainer.integrations.accelerate_sp import apply_environ, apply_to_args, route_accelerate_sp

pytestmark = pytest.mark.unit  # in-process


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """``apply_environ`` rewrites accelerate's variables in os.environ; monkeypatch restores them after each test."""
    for name in ("ACCELERATE_USE_PARALLELISM_CONFIG", "SP_SIZE", "DP_SHARD_SIZE", "DP_REPLICATE_SIZE"):
        monkeypatch.delenv(name if name.startswith("ACC") else f"PARALLELISM_CONFIG_{name}", raising=False)


def make_args(**kw):
    return TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kw)


def test_parallelism_config_sp_size_becomes_sp_size():
    with pytest.raises(ValueError, match="sp_size=2 needs 2 processes"):  # routed: the usual single-process check
        make_args(parallelism_config=ParallelismConfig(sp_size=2))


def test_env_sp_size_becomes_sp_size(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    with pytest.raises(ValueError, match="sp_size=4 needs 4 processes"):
        make_args()


def test_route_leaves_accelerate_the_data_parallel_dims(monkeypatch):
    args = make_args()
    args.parallelism_config = ParallelismConfig(sp_size=2)
    apply_to_args(args, route_accelerate_sp(args))
    assert args.sp_size == 2 and args.parallelism_config is None
    args = make_args()
    args.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, sp_size=2)
    apply_to_args(args, route_accelerate_sp(args))
    config = args.parallelism_config
    assert (args.sp_size, config.sp_size, config.dp_replicate_size, config.dp_shard_size) == (2, 1, 2, 4)
    args = make_args()
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    route = route_accelerate_sp(args)
    assert route.sp_size == 2 and route.environ == {
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "false",  # nothing left for accelerate
    }
    assert os.environ["PARALLELISM_CONFIG_SP_SIZE"] == "2"  # the route is pure: nothing set yet
    apply_to_args(args, route)
    assert args.sp_size == 2
    assert apply_environ(args) == route.environ  # the trainer's entry point, before its Accelerator reads them
    assert os.environ["PARALLELISM_CONFIG_SP_SIZE"] == "1"
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"
    assert apply_environ(args) == {}  # once rewritten there is no SP request left: idempotent


def test_building_the_config_leaves_the_environment_alone(monkeypatch):
    """Config validation is side-effect free: the environment request is routed to sp_size (here the usual
    single-process check refuses it) and the variables stay as they were."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "3")
    before = dict(os.environ)
    with pytest.raises(ValueError, match="sp_size=2 needs 2 processes"):
        make_args()
    assert dict(os.environ) == before


def test_conflicting_sp_sizes_raise():
    with pytest.raises(ValueError, match="sp_size=4 conflicts with accelerate's parallelism config sp_size=2"):
        make_args(sp_size=4, parallelism_config=ParallelismConfig(sp_size=2))


def test_tensor_parallel_with_sp_raises():
    with pytest.raises(ValueError, match="does not compose with tensor or context parallelism"):
        make_args(parallelism_config=ParallelismConfig(sp_size=2, tp_size=2, dp_shard_size=2))
