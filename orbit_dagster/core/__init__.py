"""Domain core: contracts, templates, bundles, lifecycle, metrics, costs.

Nothing here imports Dagster, boto3 or paramiko; everything above builds on it. This file
imports nothing at all: it travels in every bundle beside host_contract.py (the host has
only those two of core/, see bundle.py).
"""
