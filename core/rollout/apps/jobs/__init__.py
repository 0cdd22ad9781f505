"""The batch jobs of `rollout generate`, one module each: `generate` (prompts to responses),
`agents` (`--environment`: trajectories) and `ray_data` (`--ray-data`), on what they share:
`config` (the settings), `tables` (the input read and checked, requests and output rows),
`summary`, and `runner` (the chunked, resumable run of the first two).

`run_job` runs the job a config describes."""

from __future__ import annotations

import asyncio

from rollout.apps.jobs.config import GenerateConfig


def run_job(config: GenerateConfig, backend_options: dict, progress: bool = True) -> dict:
    """Run the job `config` describes to its summary: on Ray Data, whose actors load the
    backend, or here on a sampler opened for it and closed after."""
    if config.ray_data:
        from rollout.apps.jobs.ray_data import RayDataJob

        return RayDataJob(config).run(backend_options, progress=progress)
    if config.environment:
        from rollout.apps.jobs.agents import AgentJob

        job = AgentJob(config)
    else:
        from rollout.apps.jobs.generate import GenerateJob

        job = GenerateJob(config)
    # The job has read and checked its input: only now does a model load.
    from rollout.service.served import open_sampler

    sampler = open_sampler(config.backend, config.model, backend_options, config.replicas,
                           config.placement, config.server, config.api_key, config.mode,
                           ray=config.ray)
    try:
        return asyncio.run(job.run(sampler, progress=progress))
    finally:
        sampler.close()
