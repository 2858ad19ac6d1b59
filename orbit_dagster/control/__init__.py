"""The control plane's services: submit, run an attempt, evaluate, rank, bill, recover.

Plain Python (no Dagster import): the Dagster layer (assets, sensors, schedules) and the
CLI are thin callers of these functions, and tests reach every decision without Dagster.
"""
