"""Sensors: the queue, new checkpoints, follow-ups (best, cost), interruptions."""
