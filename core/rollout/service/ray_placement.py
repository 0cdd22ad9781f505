"""What a replica asks a Ray cluster for, and how replicas spread over its nodes.

Each replica is one bundle of a placement group: its GPUs (its engine's tensor-parallel
size; none on CPU), CPUs, memory and custom resources, always on one node. The group's
strategy places the replicas: SPREAD (the default) over as many nodes as it can, PACK onto
as few, STRICT_* as a rule. A request the cluster cannot hold fails at once, naming what
is missing; one it could hold but has no room for now fails after `ready_timeout`.
"""

from __future__ import annotations

import attrs

from rollout.contract.errors import InvalidRequestError, RolloutTimeoutError

STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")


def _resources(value) -> dict:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
            for k, v in value.items()):
        raise InvalidRequestError("ray.resources", f"got {value!r}",
                                  "a mapping of resource names to amounts >= 0")
    return dict(value)


@attrs.frozen
class RayPlacement:
    address: str | None = None  # None: the cluster of RAY_ADDRESS, or a local one
    gpus: float = 0  # per replica
    cpus: float = 1
    memory: int | None = None  # bytes per replica
    resources: dict = attrs.field(factory=dict, converter=_resources)
    strategy: str = "SPREAD"
    ready_timeout: float = 300.0  # the longest wait for room on the cluster

    def __attrs_post_init__(self):
        for name in ("gpus", "cpus", "ready_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise InvalidRequestError(f"ray.{name}", f"got {value!r}", "a number >= 0")
        if self.memory is not None and (not isinstance(self.memory, int) or self.memory <= 0):
            raise InvalidRequestError("ray.memory", f"got {self.memory!r}", "bytes, > 0")
        if not self.bundle():
            raise InvalidRequestError("ray.cpus", "a replica that asks for nothing",
                                      "cpus or gpus > 0")
        if self.strategy not in STRATEGIES:
            raise InvalidRequestError("ray.strategy", f"got {self.strategy!r}",
                                      ", ".join(STRATEGIES))

    @classmethod
    def of(cls, value: RayPlacement | dict | None) -> RayPlacement:
        if isinstance(value, RayPlacement):
            return value
        value = dict(value or {})
        unknown = sorted(set(value) - {f.name for f in attrs.fields(cls)})
        if unknown:
            raise InvalidRequestError(f"ray.{unknown[0]}", "unknown setting",
                                      ", ".join(f.name for f in attrs.fields(cls)))
        return cls(**value)

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        if self.memory:
            bundle["memory"] = self.memory
        return {k: v for k, v in bundle.items() if v}

    def actor_options(self) -> dict:
        """The replica's actor takes its whole bundle."""
        options = {"num_cpus": self.cpus, "num_gpus": self.gpus,
                   "resources": dict(self.resources)}
        if self.memory:
            options["memory"] = self.memory
        return options


def check_fits(bundle: dict[str, float], count: int, strategy: str,
               nodes: list[dict[str, float]]) -> None:
    """Raise, naming what is missing, when no placement of `count` bundles on these nodes'
    total resources exists (busy resources are not counted: those free up)."""
    def fits(node: dict, times: int = 1) -> bool:
        return all(node.get(k, 0) >= v * times for k, v in bundle.items())

    def shown(node: dict) -> str:
        return "{" + ", ".join(f"{k}: {node.get(k, 0):g}" for k in bundle) + "}"

    need = f"{count} replica(s) of {shown(bundle)}"
    where = "; ".join(shown(n) for n in nodes) or "no live node"
    if not any(fits(n) for n in nodes):
        raise InvalidRequestError("ray", f"no node of the cluster can hold one of {need} "
                                  f"(its nodes: {where})", "per-replica gpus, cpus, memory "
                                  "and resources that one node has")
    if strategy == "STRICT_SPREAD" and sum(fits(n) for n in nodes) < count:
        raise InvalidRequestError("ray.strategy", f"STRICT_SPREAD needs {count} nodes that "
                                  f"each hold {shown(bundle)} (its nodes: {where})",
                                  "SPREAD, or fewer replicas")
    if strategy == "STRICT_PACK" and not any(fits(n, count) for n in nodes):
        raise InvalidRequestError("ray.strategy", f"STRICT_PACK needs one node that holds "
                                  f"{need} (its nodes: {where})", "PACK, or fewer replicas")
    if sum(max(int(min(n.get(k, 0) // v for k, v in bundle.items() if v)), 0)
           for n in nodes if fits(n)) < count:
        raise InvalidRequestError("replicas", f"the cluster holds fewer than {need} "
                                  f"(its nodes: {where})", "fewer replicas")


def placement_group(placement: RayPlacement, count: int):
    """A ready placement group of `count` replica bundles, or the reason there is none."""
    import ray
    from ray.util.placement_group import placement_group as make_group
    from ray.util.placement_group import remove_placement_group

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    check_fits(placement.bundle(), count, placement.strategy, nodes)
    group = make_group([placement.bundle()] * count, strategy=placement.strategy)
    try:
        ray.get(group.ready(), timeout=placement.ready_timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RolloutTimeoutError(
            f"Ray found no room for {count} replica(s) of {placement.bundle()} within "
            f"{placement.ready_timeout:g} s; free now: {ray.available_resources()}") from None
    return group
