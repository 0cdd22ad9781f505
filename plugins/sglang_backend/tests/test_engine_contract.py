"""The SGLang backend, in-process sglang.Engine, against the full contract suite."""

import asyncio

import pytest
from conftest import ENGINE, KeepsWhatSGLangHeldBack

import rollout
from rollout.testing import BackendContract
from rollout.testing.adapters import lora_adapter
from rollout.testing.contract import ADAPTER, on_engine_loop, read_across_a_push
from rollout.testing.model_folders import load_weights
from rollout.testing.probes import PROBE_PROMPTS, PROBE_TOKENS


# Adapters on (with SGLang's LoRA layers in the model), so that the suite's adapter tests
# run here; test_lora runs the server mode's. Base rows compute what they do without
# LoRA (a row without an adapter gets no delta), so the references are shared.
LORA = {"enable_lora": True, "max_lora_rank": 8}


class TestSGLangEngine(BackendContract, KeepsWhatSGLangHeldBack):
    reference_key = "sglang"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="engine",
                                                  engine_args=LORA, **ENGINE)

    def test_raw_logprobs_it_cannot_give_are_refused(self, harness):
        # SGLang's logprobs come after penalties; their raw values are recomputed by a
        # prefill, which knows no constraint: that one case is refused, not approximated.
        refused, fine = harness.rollout.generate([
            {"prompt": "the ka lo", "sampling": {"logprobs": 1, "repetition_penalty": 1.2,
                                                 "structured_outputs": {"regex": "ka"}}},
            {"prompt": "the ka lo", "sampling": {"logprobs": 1, "repetition_penalty": 1.2,
                                                 "max_tokens": 4}}])
        assert refused.error.field == "sampling.logprobs"
        assert len(fine.unwrap()[0].logprobs) == fine.unwrap()[0].completion_tokens

    def test_the_requests_of_a_batch_reach_the_scheduler_in_one_message(self, harness):
        """As `sglang.Engine.generate` sends a batch, so that SGLang's first prefill takes
        them all, grouped by adapter, so that its LoRA runs one product per adapter, not
        one per row (rollout_sglang.coalesce); the results are unchanged."""
        from sglang.srt.managers.io_struct import (BatchTokenizedGenerateReqInput,
                                                   TokenizedGenerateReqInput, msgpack_decode)

        ro = harness.rollout
        socket = ro._backend.engine.llm.tokenizer_manager.send_to_scheduler
        real, sent = socket._socket, []

        class Recording:
            def send(self, data, *args, **kwargs):
                sent.append(msgpack_decode(data))
                return real.send(data, *args, **kwargs)

            def send_pyobj(self, obj, *args, **kwargs):
                sent.append(obj)
                return real.send_pyobj(obj, *args, **kwargs)

            def __getattr__(self, name):
                return getattr(real, name)

        tensors, config = lora_adapter(harness.model_dir, **ADAPTER)
        ro.load_adapter("grouped", tensors.items(), config)
        socket._socket = Recording()
        try:
            # Base rows and adapter rows interleaved, as the probe prompts twice over.
            requests = [{"prompt": p, "adapter": adapter,
                         "sampling": {"temperature": 0.0, "max_tokens": PROBE_TOKENS,
                                      "ignore_eos": True}}
                        for p in PROBE_PROMPTS for adapter in (None, "grouped")]
            done = [c.unwrap()[0].token_ids for c in ro.generate(requests)]
        finally:
            socket._socket = real
            ro.unload_adapter("grouped")
        assert tuple(done[0::2]) == harness.baseline and tuple(done[1::2]) == harness.adapted
        generates = [m for m in sent
                     if isinstance(m, BatchTokenizedGenerateReqInput | TokenizedGenerateReqInput)]
        assert len(generates) == 1, generates
        adapters = [r.lora_id for r in generates[0].batch]
        assert len(adapters) == len(requests)
        runs = [a for i, a in enumerate(adapters) if i == 0 or a != adapters[i - 1]]
        assert len(runs) == 2, adapters

    def test_a_rescored_sample_beside_a_keep_kv_update_fails_by_name(self, harness):
        """Its raw logprobs come from a prefill as it ends, which the new weights would
        run over tokens the old ones made: refused, while a plain request beside it goes
        on across the update."""
        ro, long = harness.rollout, harness.max_model_len - 16
        rescored = {"prompt": "the ka lo", "sampling": {
            "temperature": 0.0, "ignore_eos": True, "max_tokens": long, "logprobs": 0,
            "repetition_penalty": 1.2}}
        plain = {"prompt": "lo ka the", "sampling": {
            "temperature": 0.0, "ignore_eos": True, "max_tokens": long}}

        async def run():
            held = asyncio.ensure_future(ro.agenerate(rescored))
            stream = ro.stream(plain)
            update, error = await read_across_a_push(
                stream, 16, lambda: ro.update_weights(load_weights(harness.model_dir).items(),
                                                      version=4, pause="keep_kv"),
                lambda: ro.updating or ro.weight_version == 4)
            assert error is None, error
            await asyncio.wait_for(update, 120)
            return await held, stream.completion

        try:
            held, went_on = on_engine_loop(run())
        finally:
            ro.update_weights(load_weights(harness.model_dir).items())
        assert isinstance(held.error, rollout.GenerationError)
        assert "rescored" in held.error.message
        [result] = went_on.unwrap()
        assert [s.version for s in result.weight_versions] == [None, 4]
