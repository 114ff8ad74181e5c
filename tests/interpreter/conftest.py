"""The GPU-kernel tier: FLA's, Liger's and mamba_ssm's Triton kernels on CPU through Triton's interpreter.

Collected only in a process started with ``TRITON_INTERPRET=1`` (``.venv-triton``, built by ``.ci/run`` from
``constraints.txt``); anywhere else (the main suite's ``.venv``) nothing here is imported. With the variable set, the
shims are installed here, before any test module imports the libraries, and a library that does not import is an
error, not a silently empty tier.
"""

from __future__ import annotations

import importlib

import pytest

from tests.interpreter.shims import LIBRARIES, interpreting

collect_ignore_glob = [] if interpreting() else ["test_*.py"]

if interpreting():
    from tests.interpreter import shims

    shims.install()
    for _name in LIBRARIES:
        importlib.import_module(_name)  # ImportError: build .venv-triton as .ci/run does


@pytest.fixture(scope="session")
def world2() -> dict[str, dict]:
    """The 2-rank gloo world's results (``worlds.WORLD2``), spawned once for the session."""
    from tests.interpreter.worlds import run_world

    return run_world(2)


@pytest.fixture(scope="session")
def world4() -> dict[str, dict]:
    """The 4-rank gloo world's results (``worlds.WORLD4``), spawned once for the session."""
    from tests.interpreter.worlds import run_world

    return run_world(4)
