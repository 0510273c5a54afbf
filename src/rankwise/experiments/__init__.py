"""Experiments built on the library (not part of the core API)."""
