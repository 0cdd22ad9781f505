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

    def test_an_update_leaves_the_process_sharing_strategy_as_it_was(self, harness):
        """Tensors for a server that is not this process's child go as named files, and
        only they: an engine in this process (the TRL tests run one after this module)
        keeps file descriptors, which need no torch_shm_manager."""
        import torch.multiprocessing
        from transformers import AutoModelForCausalLM

        before = torch.multiprocessing.get_sharing_strategy()
        assert before != "file_system"
        model = AutoModelForCausalLM.from_pretrained(harness.model_dir)
        harness.rollout.update_weights(model.named_parameters(), version=None)
        assert torch.multiprocessing.get_sharing_strategy() == before
