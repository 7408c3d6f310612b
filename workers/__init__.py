"""Everything that runs beside an inference engine: the KV-event bridge, the KV transfer agent and
the simulated engine used by tests, the demo and load tests."""
