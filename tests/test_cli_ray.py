"""The --ray-* options become the same settings a job config's `ray:` holds."""
import pytest

from rollout.apps.cli import _ray_settings
from rollout.contract.errors import InvalidRequestError


def test_cli_settings_override_config_and_add_resources():
    base = {"cpus": 2.0, "resources": {"replica_slot": 1.0}}
    settings = _ray_settings(base, None, 1.0, None, None, ("big_node=0.5",), "PACK")
    assert settings == {"cpus": 2.0, "gpus": 1.0, "strategy": "PACK",
                        "resources": {"replica_slot": 1.0, "big_node": 0.5}}
    assert base["resources"] == {"replica_slot": 1.0}


@pytest.mark.parametrize("item", ["slot", "=1", "slot=many"])
def test_malformed_resource_is_refused_by_name(item):
    with pytest.raises(InvalidRequestError, match="--ray-resource") as caught:
        _ray_settings({}, None, None, None, None, (item,), None)
    assert "NAME=AMOUNT" in str(caught.value)
