"""Integrations for training code that is not written for orbit's SDK.

Shipped in every bundle (core/bundle.py) and imported on the rented host only by the
user's script: `env` (stdlib) reads the environment the agent sets for a command workload
(docs/bring-your-own.md); each framework's callback lives in a module of its own and
imports only its framework, the stdlib and `env`.
"""
