"""Inference engines that generate rollouts: the built-in torch KV-cache sampler
(`streamrl.engine.sampler`, CPU and GPU) and the flat result they share (`streamrl.engine.generation`).
Nothing is imported here, so a process that needs only `Generation` does not load torch."""
