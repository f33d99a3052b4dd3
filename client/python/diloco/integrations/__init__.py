"""Integrations of diloco.Worker with training frameworks (each imports its framework)."""
