"""Images in prompts on vLLM (engine, async and server mode), on a real tiny Qwen2-VL built
offline (float32, eager).

The reference is the HF backend on the same model (tested against transformers' own
`model.generate` in plugins/hf_backend/tests/test_hf_images.py): greedy tokens, and the
collapsed prompt ids (one `<|image_pad|>` per image), must be the same.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import urllib.request

import pytest

import rollout
from rollout.kit.aio import engine_loop
from rollout.kit.tiny_vlm import build_tiny_vlm
from rollout.testing.images import CASES, ask, check_against_the_processor, greedy, \
    picture, run_look

from conftest import ENGINE


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def hf(vlm_dir):
    backend = rollout.load_backend("hf", model=str(vlm_dir), dtype="float32")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf_looked(hf):
    """The reference agent trajectories (`run_look`: an image in each tool result)."""
    return run_look(hf)


@pytest.fixture(scope="module")
def ro(vlm_dir):
    backend = rollout.load_backend("vllm", model=str(vlm_dir), max_model_len=1024, **ENGINE)
    yield backend
    backend.close()


def test_a_text_model_refuses_images(shared_vllm):
    text_only = shared_vllm("engine")
    assert "text-only" in text_only.capabilities.unsupported["images"]
    assert "stats" not in text_only.health()  # no image counters to give
    completion = text_only.generate([greedy([ask(picture(0), "what?")])])[0]
    assert completion.error.field == "messages"
    assert "does not support images" in completion.error.detail


def test_greedy_equals_the_hf_backend(ro, hf):
    assert ro.capabilities.supports("images")
    requests = list(CASES.values())
    ours, theirs = ro.generate(requests), hf.generate(requests)
    image_token = ro.encoder.image_token_id
    for name, a, b in zip(CASES, ours, theirs, strict=True):
        a, b = a.unwrap()[0], b.unwrap()[0]
        assert a.prompt_token_ids == b.prompt_token_ids, name
        assert a.token_ids == b.token_ids, name
    assert ours[1].unwrap()[0].prompt_token_ids.count(image_token) == 2


def later_turn(ro) -> tuple[list, dict]:
    """The "one image" case's prompt and output, then a new user turn with a second image,
    as token ids with both images in `images` (placeholder order)."""
    first = ro.generate([CASES["one image"]])[0].unwrap()[0]
    tokenizer = ro.encoder.tokenizer
    turn = tokenizer.apply_chat_template([ask(picture(6), "and now?")], tokenize=False,
                                         add_generation_prompt=True)
    ids = (list(first.prompt_token_ids) + list(first.token_ids)
           + tokenizer("<|im_end|>\n" + turn, add_special_tokens=False).input_ids)
    return ids, {"prompt_token_ids": ids, "images": [picture(0), picture(6)],
                 "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}


def test_token_ids_with_images_continue_a_turn(ro, hf):
    """A later turn as tokens: the first turn's prompt and output, then a new user turn with
    a second image; both images go in `images`, in placeholder order."""
    ids, request = later_turn(ro)
    ours, theirs = ro.generate([request])[0].unwrap()[0], hf.generate([request])[0].unwrap()[0]
    assert ours.prompt_token_ids == tuple(ids) == theirs.prompt_token_ids
    assert ours.token_ids == theirs.token_ids
    # The same turn again gives the same tokens (the images now come from vLLM's caches).
    assert ro.generate([request])[0].unwrap()[0].token_ids == ours.token_ids


def test_a_bad_image_fails_its_own_request(ro):
    bad, ok = ro.generate([greedy([ask(b"not an image", "what?")], 4),
                           greedy([ask(picture(8), "fine")], 4)])
    assert ok.ok
    assert isinstance(bad.error, rollout.InvalidRequestError)
    assert bad.error.field == "messages[0].content[0]"


def test_a_repeated_image_is_processed_once(ro):
    """vLLM's multimodal processor cache, keyed by our image ids: a later turn that repeats
    an earlier image and adds one runs the image processor on the new one only."""
    cache = ro._backend.engine.engine.renderer.mm_processor_cache
    # Cumulative (vLLM reads the deltas itself, per request): (hits, images looked up).
    before = cache.make_stats()
    history = [ask(picture(20), "first"), {"role": "assistant", "content": "ok"}]
    ro.generate([greedy(history, 4)])[0].unwrap()
    middle = cache.make_stats()
    assert (middle.hits - before.hits, middle.total - before.total) == (0, 1)
    ro.generate([greedy(history + [ask(picture(21), "second")], 4)])[0].unwrap()
    after = cache.make_stats()
    assert (after.hits - middle.hits, after.total - middle.total) == (1, 2)


def test_the_cache_counts_go_on_across_a_clear():
    """vLLM zeroes its cache's counts when it clears the cache (on sleep, which its CPU
    build lacks); `stats()` keeps those read just before."""
    from types import SimpleNamespace

    from vllm.utils.cache import LRUCache

    from rollout_vllm.common import MMCacheCounts
    from rollout_vllm.common import counted_across_clear as _counted_across_clear

    lru = LRUCache(100)
    counts = MMCacheCounts(SimpleNamespace(make_stats=lru.stat))
    lru["a"] = 1
    lru.get("a"), lru.get("b")  # a hit and a miss
    with _counted_across_clear(counts):
        lru.clear()  # as vLLM's sleep clears its processor cache
    for key in "abc":  # more lookups than before the clear
        lru.get(key)
    assert counts.read() == (1, 5)


def test_agent_trajectories_equal_the_hf_backend(ro, hf_looked, vlm_dir):
    check_look(ro, hf_looked, vlm_dir)


@pytest.fixture(scope="module")
def ro_async(vlm_dir, ro):
    ro.close()  # one vLLM engine at a time
    backend = rollout.load_backend("vllm", model=str(vlm_dir), mode="async",
                                   max_model_len=1024, **ENGINE)
    yield backend
    backend.close()


def test_async_mode_equals_the_hf_backend(ro_async, hf):
    """AsyncLLM renders image prompts in this process and runs the model in its core's."""
    assert ro_async.capabilities.supports("images")
    requests = [CASES["two images"], CASES["an image in a tool message"], CASES["text only"]]
    for a, b in zip(ro_async.generate(requests), hf.generate(requests), strict=True):
        a, b = a.unwrap()[0], b.unwrap()[0]
        assert (a.prompt_token_ids, a.token_ids) == (b.prompt_token_ids, b.token_ids)


def test_async_mode_agent_trajectories_equal_the_hf_backend(ro_async, hf_looked, vlm_dir):
    check_look(ro_async, hf_looked, vlm_dir)


@pytest.fixture(scope="module")
def ro_server(vlm_dir, ro_async):
    ro_async.close()  # one vLLM at a time
    # Blocks of 32 tokens: a short prompt fills one, so a repeated one is cached. At most 4
    # sequences a step: the abort test's batch then runs for a minute, not seconds.
    backend = rollout.load_backend("vllm", model=str(vlm_dir), mode="server",
                                   max_model_len=1024, **ENGINE,
                                   engine_args={"block_size": 32, "max_num_seqs": 4})
    yield backend
    backend.close()


def test_server_mode_equals_the_hf_backend(ro_server, hf):
    """Image requests go to the server's /inference/v1/generate, text ones to
    /v1/completions; the same tokens either way."""
    assert ro_server.capabilities.supports("images")
    requests = list(CASES.values())
    for name, a, b in zip(CASES, ro_server.generate(requests), hf.generate(requests),
                          strict=True):
        a, b = a.unwrap()[0], b.unwrap()[0]
        assert (a.prompt_token_ids, a.token_ids) == (b.prompt_token_ids, b.token_ids), name


def test_server_mode_continues_a_turn_from_the_cache(ro_server, hf):
    """Token ids with images for a later turn, as HF makes them; sent twice, the second
    finds the prompt's first blocks, image included, in vLLM's prefix cache."""
    ids, request = later_turn(ro_server)
    ours = ro_server.generate([request])[0].unwrap()[0]
    assert ours.token_ids == hf.generate([request])[0].unwrap()[0].token_ids
    again = ro_server.generate([request])[0].unwrap()[0]
    assert again.token_ids == ours.token_ids
    assert again.cached_tokens >= 32


def test_server_mode_honours_sampling_on_image_requests(ro_server, hf):
    """Logprobs (against HF's), the whole top k when the sampled token is not in it, seeds,
    stop tokens and strings, n, and streaming token by token."""
    messages = [ask(picture(9), "describe")]
    greedy_lp = {"messages": messages, "sampling": {"temperature": 0, "max_tokens": 6,
                                                    "logprobs": 3, "ignore_eos": True}}
    a, b = ro_server.generate([greedy_lp])[0].unwrap()[0], hf.generate([greedy_lp])[0].unwrap()[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    assert [[t.token_id for t in top] for top in a.top_logprobs] == \
        [[t.token_id for t in top] for top in b.top_logprobs]

    def sampled(**sampling):
        request = {"messages": messages, "sampling": {"temperature": 1.0, "seed": 7,
                                                      "max_tokens": 12, **sampling}}
        return ro_server.generate([request])[0].unwrap()

    three, five = sampled(logprobs=3)[0], sampled(logprobs=5)[0]
    assert three.token_ids == five.token_ids  # the seed
    assert list(three.top_logprobs) == [top[:3] for top in five.top_logprobs]
    # Some sampled token lies outside its top 3 (else the check above proves little).
    assert any(t not in [x.token_id for x in top]
               for t, top in zip(three.token_ids, three.top_logprobs))
    stop = three.token_ids[4]
    stopped = sampled(stop_token_ids=[stop])[0]
    assert stopped.token_ids[-1] == stop and stopped.finish_reason == "stop"
    text = three.text[4:7]  # a stop string: the server detokenizes to find it
    stopped = sampled(stop=[text])[0]
    assert stopped.finish_reason == "stop" and three.text.startswith(stopped.text)
    assert text not in stopped.text
    assert len(sampled(n=2, seed=None)) == 2

    async def stream():
        return [len(c.token_ids) async for c in ro_server.stream(greedy(messages, 5))]

    # One token an event to a reader that keeps up; merged for a starved one (vLLM merges
    # what is not read yet), so what always holds is that no event is empty.
    sizes = asyncio.run(stream())
    assert sum(sizes) == 5 and all(sizes), sizes


def test_server_mode_aborts_image_requests(ro_server):
    """An aborted request closes its connection, and the server stops it. 32 requests of 4
    samples of 900 tokens, 4 sequences a step (one request at a time): once the server
    holds two of them (one running, one queued), all are aborted, the later ones queued
    or still on their way. The test runs on the engine loop, where the streams are read
    (another thread of this process may not run while they pour in)."""
    long = {"messages": [ask(picture(10), "go on")],
            "sampling": {"temperature": 1.0, "max_tokens": 900, "ignore_eos": True, "n": 4}}
    ids = [f"long-{i}" for i in range(32)]

    async def run():
        tasks = [asyncio.ensure_future(ro_server.agenerate({**long, "id": i})) for i in ids]
        deadline = time.monotonic() + 120
        # The server counts each sample as a request. A busy vLLM engine on CPU can starve
        # its own server's image processing, so requests may arrive one per generation:
        # the test waits for two, not for all.
        while await asyncio.to_thread(running, ro_server) < 8:
            assert time.monotonic() < deadline, "the server never held two requests"
            await asyncio.sleep(0.1)
        done = sum(t.done() for t in tasks)
        ro_server.abort(ids)
        return done, await asyncio.gather(*tasks)

    done, completions = engine_loop().run(run(), 300, "the test")
    reasons = [r.finish_reason for c in completions for r in c.unwrap()]
    # A request needs 900 steps (seconds) to its length: besides those done, a few more may
    # have reached it before the abort took effect (a busy engine can starve this process
    # for seconds); every other one was aborted, queued or on its way.
    late = 4  # requests
    assert set(reasons) <= {"abort", "length"}, reasons
    assert reasons.count("abort") >= 4 * (len(ids) - done - late), (done, reasons)
    deadline = time.monotonic() + 30
    while running(ro_server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(ro_server) == 0
    made = counter(ro_server, "generation_tokens")
    time.sleep(1)
    assert counter(ro_server, "generation_tokens") == made  # nothing runs on


def test_server_mode_processes_a_repeated_image_once(ro_server):
    """vLLM's processor cache, keyed by our image ids, as its server's /metrics counts it:
    a later turn that repeats an earlier image runs the processor on the new one only."""
    before = mm_cache(ro_server)
    history = [ask(picture(30), "first"), {"role": "assistant", "content": "ok"}]
    ro_server.generate([greedy(history, 4)])[0].unwrap()
    middle = mm_cache(ro_server)
    assert (middle[0] - before[0], middle[1] - before[1]) == (0, 1)
    ro_server.generate([greedy(history + [ask(picture(31), "second")], 4)])[0].unwrap()
    after = mm_cache(ro_server)
    assert (after[0] - middle[0], after[1] - middle[1]) == (1, 2)


def test_server_mode_agent_trajectories_equal_the_hf_backend(ro_server, hf_looked, vlm_dir):
    check_look(ro_server, hf_looked, vlm_dir)


def check_look(ro, reference, vlm_dir) -> None:
    """`run_look` on vLLM: the HF backend's trajectories token for token, the same images
    added per turn, each what the processor makes of the whole conversation; and vLLM's
    processor ran on each turn's new images only (`health()["stats"]`)."""
    before = ro.health()["stats"]
    done = run_look(ro)
    after = ro.health()["stats"]
    assert [t.response_ids for t in done] == [t.response_ids for t in reference]
    for t, ref in zip(done, reference, strict=True):
        assert t.end_reason == "done", t.end_detail
        assert [turn.images_added for turn in t.turns] == \
            [turn.images_added for turn in ref.turns]
        check_against_the_processor(t, vlm_dir)
    # Every turn sends all of its images (by uuid where sent before); each is processed once,
    # the first time any trajectory sends it, and found in vLLM's processor cache after that
    # (no image of `run_look` was sent to this engine before).
    new = {i.id for t in done for i in t.images}
    sent = sum(sum(itertools.accumulate(len(turn.images_added) for turn in t.turns))
               for t in done)
    assert sent > len(new)
    assert {k: after[k] - before[k] for k in after} == \
        {"images_processed": len(new), "image_cache_hits": sent - len(new)}


def metrics(ro) -> str:
    with urllib.request.urlopen(ro._backend.engine.url + "/metrics", timeout=60) as r:
        return r.read().decode()


def counter(ro, name: str) -> float:
    """One of the server's counters, summed over its labels."""
    return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$",
                                            metrics(ro), re.MULTILINE))


def mm_cache(ro) -> tuple[float, float]:
    """The server's multimodal processor cache counters: (hits, images looked up)."""
    return counter(ro, "mm_cache_hits"), counter(ro, "mm_cache_queries")


def running(ro) -> float:
    """The server's own count of requests running or waiting."""
    return sum(float(v) for v in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", metrics(ro), re.MULTILINE))
