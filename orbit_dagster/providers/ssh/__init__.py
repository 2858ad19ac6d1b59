"""The ssh provider: see provider.py."""
