"""rankwise."""
