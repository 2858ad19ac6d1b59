"""Domain core: contracts, templates, bundles, lifecycle, metrics, costs.

Nothing here imports Dagster, boto3 or paramiko; everything above builds on it.
"""
