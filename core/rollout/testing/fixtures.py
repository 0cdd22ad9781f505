"""Pytest fixtures for backend test suites: `pytest_plugins = ["rollout.testing.fixtures"]`
in a conftest.py gives its tests `tiny_model`, the tiny model folder, built once per run."""

import pytest

from rollout.testing.models import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "rollout-models")
