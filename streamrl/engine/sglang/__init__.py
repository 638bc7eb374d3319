"""sglang as a streamrl inference engine: servers started and driven over their HTTP API
(`server`: the child processes; `engine`: groups with exact per-token versions, per-engine weight
updates; the endpoints themselves: `streamrl.sglang`). No sglang import: the servers are separate processes."""
