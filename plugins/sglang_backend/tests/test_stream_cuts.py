"""Where a streamed sample ends when SGLang cannot stop it itself (stop tokens with
ignore_eos, stop strings with min_tokens), how a sample to be rescored is held back, and
how tokens kept across a weight update are split by the weights that made them: the
backend's per-sample logic on a toy vocabulary, no engine."""

from rollout import SamplingParams
from rollout_sglang.backend import _Sample, by_weights, joined
from rollout_sglang.protocol import Delta

PIECES = ["a", "bb", "c", "dd", "e", "f"]


def decode(ids) -> str:
    return "".join(PIECES[t] for t in ids)


def feed(s: SamplingParams, *deltas, held_back: bool = False, logprobs: bool = False):
    sample = _Sample(s, decode, held_back)
    out = []
    for ids in deltas:
        lps = [-float(t) for t in ids] if logprobs else None
        out.append(sample.add(Delta(list(ids), lps, None, None))[:4])
        if out[-1][3] is not None:
            break
    return out


def test_a_stop_token_under_ignore_eos_ends_the_sample_there():
    s = SamplingParams(ignore_eos=True, stop_token_ids=(3,), max_tokens=20, logprobs=0)
    first, second = feed(s, [0, 1], [2, 3, 4, 5], logprobs=True)
    assert first == ([0, 1], [-0.0, -1.0], None, None)
    assert second == ([2, 3], [-2.0, -3.0], None, "stop")


def test_stop_tokens_are_left_to_sglang_without_ignore_eos():
    s = SamplingParams(stop_token_ids=(3,), max_tokens=20)
    assert feed(s, [2, 3, 4])[0][0] == [2, 3, 4]


def test_a_stop_string_counts_only_after_min_tokens():
    s = SamplingParams(stop=("bbc",), min_tokens=2, max_tokens=20)
    # "bbc" is made by the first two tokens (held back by min_tokens), then again later.
    first, second = feed(s, [1, 2], [0, 1, 2, 4])
    assert first[0] == [1, 2] and first[3] is None
    assert second == ([0, 1, 2], None, None, "stop")


def test_a_stop_string_across_chunks_ends_at_the_token_that_completes_it():
    s = SamplingParams(stop=("cd",), min_tokens=1, max_tokens=20)
    first, second = feed(s, [0, 1, 2], [3, 4])
    assert first[3] is None
    assert second == ([3], None, None, "stop")


def test_the_stop_string_that_ends_first_wins_over_a_later_stop_token():
    s = SamplingParams(stop=("bb",), min_tokens=1, ignore_eos=True, stop_token_ids=(4,),
                       max_tokens=20)
    (only,) = feed(s, [0, 1, 2, 4])
    assert only == ([0, 1], None, None, "stop")


def test_a_sample_to_be_rescored_comes_out_whole_at_its_end():
    s = SamplingParams(ignore_eos=True, stop_token_ids=(3,), max_tokens=20)
    first, second = feed(s, [0, 1], [2, 3, 4], held_back=True)
    assert first == ([], None, None, None)
    assert second == ([0, 1, 2, 3], None, None, "stop")


def test_an_uncut_sample_keeps_sglangs_finish():
    sample = _Sample(SamplingParams(max_tokens=3), decode, False)
    assert sample.add(Delta([0, 1, 2], None, None, "length"))[:4] == \
        ([0, 1, 2], None, None, "length")


def masks(ids) -> list:
    return [(t, t + 1) for t in ids]


def test_sampling_masks_are_cut_with_their_tokens_and_held_back_with_them():
    s = SamplingParams(ignore_eos=True, stop_token_ids=(3,), max_tokens=20)
    cut = _Sample(s, decode, False).add(Delta([2, 3, 4], None, None, None,
                                              sampling_mask=masks([2, 3, 4])))
    assert (cut.token_ids, cut.sampling_mask, cut.finish_reason) == ([2, 3], masks([2, 3]),
                                                                      "stop")
    held = _Sample(s, decode, True)
    assert held.add(Delta([0, 1], None, None, None, sampling_mask=masks([0, 1]))) == \
        Delta([], None, None, None)
    whole = held.add(Delta([2, 3, 4], None, None, None, sampling_mask=masks([2, 3, 4])))
    assert (whole.token_ids, whole.sampling_mask) == ([0, 1, 2, 3], masks([0, 1, 2, 3]))


def test_tokens_kept_across_an_update_come_out_in_runs_of_the_weights_that_made_them():
    """SGLang's spans are over the whole sample; the kept tokens are its last ones, and
    each run carries its own logprobs and masks."""
    kept = joined([Delta([4, 5], [-4.0, -5.0], None, None, sampling_mask=[(4,), (5,)]),
                   Delta([6], [-6.0], None, "length", sampling_mask=[(6, 7)])])
    assert kept.token_ids == [4, 5, 6] and kept.finish_reason == "length"
    # tokens 0-3 came out before the update began; the edge is after token 4
    runs = by_weights(kept, 7, [(0, 0, 5), (1, 5, 7)])
    assert [(u, r.token_ids, r.logprobs, r.sampling_mask) for u, r in runs] == [
        (0, [4], [-4.0], [(4,)]), (1, [5, 6], [-5.0, -6.0], [(5,), (6, 7)])]
    # a third update named before the request ended, with no token of it
    assert [u for u, _ in by_weights(kept, 7, [(0, 0, 5), (1, 5, 7), (2, 7, 7)])] == [0, 1]


def test_a_finish_alone_goes_to_the_last_weights():
    finish = Delta([], None, None, "stop")
    assert by_weights(finish, 3, [(0, 0, 2), (1, 2, 3)]) == [(1, finish)]
