"""Schedules: the daily offer-catalog discovery and the evaluation backfill."""
