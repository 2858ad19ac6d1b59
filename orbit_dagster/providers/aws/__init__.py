"""The aws provider: see provider.py."""
