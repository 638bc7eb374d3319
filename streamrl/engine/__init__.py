"""Inference engines behind one interface (`streamrl.engine.base`): the built-in torch engine with
continuous batching (`torch_engine`, CPU and GPU), sglang servers (`sglang`), and the simulator's timing
model (`streamrl.engine.sim`). Nothing is imported here, so a process that needs only the sample types
does not load torch."""
