"""Both SGLang engines offer the interface the backend and the weight senders call
(rollout_sglang.engine): every method of it, with its parameters, async where it is; the
server engine also the group calls of the gloo transport."""

import inspect
from typing import Protocol

import pytest

from rollout_sglang.engine import Engine, GroupEngine
from rollout_sglang.engines import InProcessEngine, ServerEngine


def methods(protocol) -> dict:
    return {name: fn for cls in protocol.__mro__ if cls not in (object, Protocol)
            for name, fn in vars(cls).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def shape(fn) -> tuple:
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    return params, inspect.iscoroutinefunction(fn)


@pytest.mark.parametrize("engine, protocol", [(InProcessEngine, Engine),
                                              (ServerEngine, GroupEngine)])
def test_each_engine_offers_its_protocol(engine, protocol):
    wanted = methods(protocol)
    assert {"generate", "stream", "run", "close"} <= set(wanted)
    for name, fn in wanted.items():
        assert hasattr(engine, name), f"{engine.__name__} has no {name}"
        assert shape(getattr(engine, name)) == shape(fn), name


def test_only_the_server_engine_joins_a_group():
    group_calls = set(methods(GroupEngine)) - set(methods(Engine))
    assert group_calls == {"init_group", "update_distributed", "destroy_group"}
    assert not group_calls & set(dir(InProcessEngine))
