"""kvgate's gateway core: the routing decision, its cost model, config, CLI and admin API."""
