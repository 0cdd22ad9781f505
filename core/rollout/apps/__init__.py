"""The applications built on the core: the batch job (`job`), the HTTP server and the
replica pool (`serving`), evaluation (`evaluate`, `judges`, `datasets`), tool-call parsers
(`tool_parsers`), and the `rollout` command line (`cli`)."""
