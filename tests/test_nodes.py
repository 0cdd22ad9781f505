"""A process's node, as weight updates compare it to choose shared memory or gloo."""
import subprocess
import sys

from rollout.weights.transports.nodes import NODE_VARIABLE, same_node, this_node

ASK = "from rollout.weights.transports.nodes import this_node; print(this_node())"


def node_of_child(**env) -> str:
    import os

    environment = {k: v for k, v in os.environ.items() if k != NODE_VARIABLE}
    return subprocess.run([sys.executable, "-c", ASK], env={**environment, **env},
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_processes_of_one_machine_name_the_same_node(monkeypatch):
    monkeypatch.delenv(NODE_VARIABLE, raising=False)
    assert this_node().startswith("host:")
    assert node_of_child() == this_node()


def test_a_node_handed_down_wins(monkeypatch):
    assert node_of_child(**{NODE_VARIABLE: "ray:abc"}) == "ray:abc"
    monkeypatch.setenv(NODE_VARIABLE, "ray:abc")
    assert same_node({"ray:abc"})
    assert not same_node({"ray:abc", "ray:def"})
    assert not same_node(())  # receivers whose node is unknown are not here
