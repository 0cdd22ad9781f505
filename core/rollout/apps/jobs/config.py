"""A batch job's settings (`GenerateConfig`) and how they are read: a YAML file, then the
command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import SamplingParams


@attrs.frozen
class GenerateConfig:
    """Where the job runs (see rollout.service.connect for the modes): a backend in this
    process (the default), `replicas` processes of it (placed locally or by Ray), or a
    running `rollout serve` at `server`."""

    input: str
    output: str
    backend: str | None = None
    model: str | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    backend_options: dict = attrs.field(factory=dict)
    chunk_size: int = 256
    mode: str | None = None
    replicas: int | None = None
    placement: str = "local"
    ray: dict = attrs.field(factory=dict)  # RayPlacement's fields, with placement ray
    # The job on Ray Data (rollout.apps.jobs.ray_data): `replicas` actors each hold the
    # backend, and `output` is a folder of parquet parts.
    ray_data: bool = False
    server: str | None = None
    api_key: str | None = None
    in_flight: int | None = None
    # Trajectories instead of single responses (rollout.apps.jobs.agents): an environment
    # by entry-point name or module:object, its options, and AgentConfig's limits.
    environment: str | None = None
    environment_options: dict = attrs.field(factory=dict)
    agent: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self):
        for name in ("chunk_size", "in_flight", "replicas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(name, f"got {value!r}", "an integer >= 1")
        if self.placement not in ("local", "ray"):
            raise InvalidRequestError("placement", f"got {self.placement!r}", "local, ray")
        if self.ray:
            from rollout.service.ray_placement import RayPlacement

            RayPlacement.of(self.ray)  # its errors name the setting, before anything starts
        if self.ray_data and self.mode not in (None, "standalone"):
            raise InvalidRequestError("mode", f"{self.mode} with ray_data, whose replicas "
                                      "are Ray Data's actors", "standalone, or no mode")
        if self.server and self.replicas:
            raise InvalidRequestError("server", "given with replicas",
                                      "either --server URL or --replicas N")
        if not self.server:
            for key in ("backend", "model"):
                if getattr(self, key) is None:
                    raise InvalidRequestError(key, "missing",
                                              f"--{key} or `{key}:` in the config file")


def load_config(path: str | None, overrides: dict[str, Any]) -> GenerateConfig:
    """Settings from a YAML file, then from the command line (which wins; None: not given).
    An override named after a sampling parameter goes into `sampling`."""
    data: dict = {}
    if path:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidRequestError("config", f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("config", f"{path} is not a mapping of settings")
    sampling = dict(data.get("sampling") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key in attrs.fields_dict(SamplingParams):
            sampling[key] = value
        else:
            data[key] = value
    data["sampling"] = sampling
    for key in ("input", "output"):
        if key not in data:
            raise InvalidRequestError(key, "missing", f"--{key} or `{key}:` in the config file")
    return convert.structure(data, GenerateConfig)
