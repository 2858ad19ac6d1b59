"""Example workloads. Each is a directory of scripts whose `main(ctx)` the runtime agent calls."""
