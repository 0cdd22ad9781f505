"""Asynchronous RL over any `Sampler`: `GroupSampler` keeps groups of samples in flight
while the trainer trains, within a staleness bound (`staleness.Staleness`)."""

from rollout.apps.rl.groups import Group, GroupSampler, has_spread
from rollout.apps.rl.staleness import POLICIES, Staleness

__all__ = ["Group", "GroupSampler", "POLICIES", "Staleness", "has_spread"]
