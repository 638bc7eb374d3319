"""Weights without a global barrier: the trainer publishes `(version, weights)` and moves on; each
producer picks up the newest version on its own schedule. Modules: `registry` (which versions live),
`actor` (the registry on Ray, and the trainer's publisher), `arrays` (weights as numpy), and one module
per way a version reaches an engine: `shared_memory` (to producers on the trainer's machine) and
`receiver` (object store; both into an engine in the producer's own process), `disk`, `tensor_handles`
and `broadcast` (into sglang servers, behind the one interface and factory of `server_paths`). Nothing
is imported here, so the weights actor's process does not load torch."""
