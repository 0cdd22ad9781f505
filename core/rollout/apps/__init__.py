"""The applications built on the core: the batch jobs (`jobs`), the HTTP server
(`serving`), the agent runner (`agents`), evaluation (`evaluate`, `judges`, `datasets`),
tool-call parsers (`tool_parsers`), and the `rollout` command line (`cli`)."""
