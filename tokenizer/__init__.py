"""Prompt → token IDs exactly as the serving engine does it, and token IDs → chained block keys."""
