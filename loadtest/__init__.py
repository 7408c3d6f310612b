"""Load testing and simulation: replay real or synthetic traffic against a fleet under several
routing policies (``kvgate loadtest replay``), or run the same policy and engine code on a virtual
clock (``kvgate loadtest simulate``). See README.md here.

Nothing in the project imports this package; it imports everything else.
"""
