"""Typed errors cross process boundaries (Ray actors, process pools) by pickle with their
type and fields intact."""

import pickle

import pytest

from rollout.contract import errors

CASES = [errors.InvalidRequestError("sampling.top_p", "must be in (0, 1]", "0 < top_p <= 1"),
         errors.UnknownImageError("images[0]", "unknown uuid"),
         errors.UnsupportedError("release", "not on this engine"),
         errors.EngineDeadError("the engine exited"),
         errors.RolloutTimeoutError("no answer within 5 s")]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_errors_survive_pickle(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.to_dict() == error.to_dict() and str(copy) == str(error)
