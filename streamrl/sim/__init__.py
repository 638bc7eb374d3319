"""The simulator's timing model (`workload`): what a decode step, a prefill and a train step cost, and
the response-length distribution. Its engine, learner and task live with their kinds
(`streamrl.engine.sim`, `streamrl.trainer.sim`, `streamrl.tasks.sim`)."""
