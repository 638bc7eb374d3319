"""sglang as a streamrl inference engine: servers started and driven over their HTTP API
(`server`: the child processes; `client`: the endpoints; `engine`: groups with exact per-token
versions, per-engine weight updates). No sglang import: the servers are separate processes."""
