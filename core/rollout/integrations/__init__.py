"""Adapters that put `rollout` under trainers people already run (TRL). Each is imported
only by its user: none is loaded by `import rollout`."""
