"""Fault injection and load: checks that the pipeline holds up when things go wrong or run long."""
