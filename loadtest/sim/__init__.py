"""The discrete-event simulator behind ``kvgate loadtest simulate`` (see simulator.py)."""
