"""Deployment: profiles, the dagster.yaml they render, the Dagster instance and its lock, the
long-running services (code server, daemon, webserver) and their logs, the run coordinator
and launcher the instance names, and `orbit profile`'s report."""
