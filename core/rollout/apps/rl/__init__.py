"""Asynchronous RL over any `Sampler`: `GroupSampler` keeps groups of samples in flight
while the trainer trains, within a staleness bound (`staleness.Staleness`);
`versions.largest_gap` checks that each token's logprob is its version's; `harness.Harness` makes each sample an unchanged agent
program's episode, its tokens recorded by the server's sessions; `mismatch` measures how
far the trainer is from the sampling policy and `importance_weights` corrects for it."""

from rollout.apps.rl.groups import Group, GroupSampler, has_spread
from rollout.apps.rl.harness import AgentCall, Episode, Harness, gateway
from rollout.apps.rl.mismatch import CORRECTIONS, importance_weights, mismatch
from rollout.apps.rl.staleness import POLICIES, Staleness
from rollout.apps.rl.versions import first_and_later_gaps, largest_gap, versions_in

__all__ = ["CORRECTIONS", "POLICIES", "AgentCall", "Episode", "Group", "GroupSampler",
           "Harness", "Staleness", "first_and_later_gaps", "gateway", "has_spread",
           "importance_weights", "largest_gap", "mismatch", "versions_in"]
