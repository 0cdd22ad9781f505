"""The SGLang backend in server mode with weight_transport="tensor" (the default there is
"gloo"), against the contract suite's weight-update tests; the rest is test_server_contract."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract, WeightTestsOnly


class TestSGLangServerTensor(WeightTestsOnly, BackendContract):
    reference_key = "sglang"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="server",
                                                  weight_transport="tensor", **ENGINE)
