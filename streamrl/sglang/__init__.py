"""sglang's HTTP API as streamrl speaks it: every route, request field, sampling key and launch flag
(`protocol`, checked against the real server's source by `benchmarks/sglang_conformance.py`) and a
client of those routes (`client`). Standard library only: the engine (`streamrl.engine.sglang`) and the
weight transports (`streamrl.weights`) both talk to servers through it."""
