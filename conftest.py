"""Settings for every test under this repository."""
from hypothesis import settings

# Hypothesis's per-example deadline is wall-clock time: on a loaded machine it fails tests
# that are correct (seen: tests/test_buckets.py beside other work). None here.
settings.register_profile("rollout", deadline=None)
settings.load_profile("rollout")
