"""The simulated inference engine behind ``kvgate worker``.

Mechanism in pure, clock-free classes (``kv_cache.PrefixCache``, ``scheduler.Scheduler``) that a
discrete-event simulator can drive with a virtual clock; I/O only in ``server`` (aiohttp, real
time scaled by ``--time-scale``) and ``events`` (ZMQ KV-event publishing).
"""
