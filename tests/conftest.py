pytest_plugins = ["rollout.testing.fixtures"]
