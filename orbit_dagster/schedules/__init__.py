"""Schedules: the daily offer-catalog discovery, the daily cost insight and the evaluation backfill."""
