"""Experiments built on the library (not part of the core API)."""

from .._extras import quiet_optional_logs

quiet_optional_logs()  # (run in every worker process too: they import this package)
