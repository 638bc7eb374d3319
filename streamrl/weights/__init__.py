"""Weights without a global barrier: the trainer publishes `(version, weights)` and moves on; each
producer picks up the newest version on its own schedule. Modules: `registry` (which versions live),
`actor` (the registry on Ray), `receiver` (a producer's background fetch and swap), `arrays` (weights
as numpy). Nothing is imported here, so the weights actor's process does not load torch."""
