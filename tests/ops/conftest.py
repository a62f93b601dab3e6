"""Fixtures of the ops checks. The process machinery (DsProcess, Cluster: the real binary on free
loopback ports, always stopped) is the integration suite's, loaded from tests/integration/conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_spec = importlib.util.spec_from_file_location(
    "ds_integration", os.path.join(os.path.dirname(HERE), "integration", "conftest.py"))
ds = importlib.util.module_from_spec(_spec)
sys.modules["ds_integration"] = ds
_spec.loader.exec_module(ds)

# Failing tests get the stderr tails of the processes they started (the integration suite's hook).
pytest_runtest_makereport = ds.pytest_runtest_makereport


@pytest.fixture(scope="session")
def ops_env():
    with tempfile.TemporaryDirectory(prefix="deltaserve-ops-home-") as home:
        yield ds.base_env(home)


@pytest.fixture(scope="session")
def ops_logdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ops-logs"))


@pytest.fixture(scope="session")
def ops_model_dir(ops_env, tmp_path_factory):
    ds.require_serve()
    d = str(tmp_path_factory.mktemp("ops-model") / "tiny-linear")
    ds.run_cli(ops_env, "make-model", "--preset", "tiny-linear", "--out", d)
    return d
