"""Problem sets turned into the prompt-and-tests format of `rollout generate` and `rollout eval`."""
