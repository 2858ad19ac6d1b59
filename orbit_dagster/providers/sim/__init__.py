"""The sim provider: see provider.py."""
