"""Data shipped with the load tests (see README.md here)."""
