"""Pytest fixtures for backend test suites: `pytest_plugins = ["rollout.testing.fixtures"]`
in a conftest.py gives its tests `tiny_model`, the tiny model folder, built once per run, and `real_model`,
the real model folder (rollout.kit.models)."""

import pytest

from rollout.testing.model_folders import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "rollout-models")


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct converted by `rollout model smollm2`, from the cache that
    command keeps (fetched and converted the first time: about a minute)."""
    from rollout.kit.models import ensure

    return ensure("smollm2")
