import pytest

from rollout.testing import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "rollout-models")
