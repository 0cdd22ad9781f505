"""Asynchronous RL over any `Sampler`: `GroupSampler` keeps groups of samples in flight
while the trainer trains, within a staleness bound (`staleness.Staleness`); `versions.largest_gap` checks that each
token's logprob is its version's."""

from rollout.apps.rl.groups import Group, GroupSampler, has_spread
from rollout.apps.rl.staleness import POLICIES, Staleness
from rollout.apps.rl.versions import largest_gap, versions_in

__all__ = ["Group", "GroupSampler", "POLICIES", "Staleness", "has_spread", "largest_gap",
           "versions_in"]
