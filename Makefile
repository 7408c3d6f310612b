# Two commands are all the set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test chaos install vllm clean image

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The chart tests' extra (Helm SDK + Kubernetes schemas, ~250 MB): only `make test` needs it.
HELM_STAMP := $(VENV)/.installed-helm-test
$(HELM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[helm-test]'
	touch $(HELM_STAMP)

# The peer router the bench and replay tests run (sglang-router, Rust wheel): only `make test` needs it.
LOADTEST_STAMP := $(VENV)/.installed-loadtest
$(LOADTEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[loadtest]'
	touch $(LOADTEST_STAMP)

# System packages the tests load, from Debian's registry when missing: libibverbs (Mooncake's
# transfer engine links it even for TCP) and Chromium (the dashboard test renders the page).
SYSDEPS := $(VENV)/.installed-sysdeps
$(SYSDEPS): $(STAMP)
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 ' || ! command -v chromium >/dev/null; then \
	  echo "installing libibverbs1 and chromium (apt-get)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 chromium >/dev/null; \
	fi
	touch $(SYSDEPS)

# Real vLLM (CPU build, ~3.4 GB, 3-8 min) in a venv of its own: its pins (setuptools, numpy via
# numba, transformers) are not kvgate's. The conformance tests run against it (docs/real-vllm.md).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-0.32.0
$(VLLM_STAMP): $(STAMP)
	$(BIN)/kvgate vllm install --venv $(VLLM_VENV)

install: $(STAMP)

vllm: $(VLLM_STAMP)

# Docker and debootstrap for the image test (tests/test_image.py), from Debian's packages when missing.
DOCKERDEPS := $(VENV)/.installed-docker
$(DOCKERDEPS): $(STAMP)
	@if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then \
	  echo "installing docker.io and debootstrap (apt-get)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null; \
	fi
	touch $(DOCKERDEPS)

# kvgate's container image (Dockerfile; docs/image.md). IMAGE is the chart's default image;
# an empty BASE_IMAGE builds on a Debian base made here with debootstrap (no registry needed).
# PIP_CERT: the CA bundle pip uses on this machine, handed to the build as a secret.
IMAGE ?= kvgate:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BASE_IMAGE ?=
PIP_CERT ?= $(shell $(PY) -m pip config get global.cert 2>/dev/null)
image:
	IMAGE='$(IMAGE)' BASE_IMAGE='$(BASE_IMAGE)' PIP_CERT='$(PIP_CERT)' image/build.sh

demo: $(STAMP)
	$(BIN)/kvgate demo

# The long chaos suite (tests/chaos, ~2 min, attacks under load included) runs under `make chaos`,
# then the hostile suites (every attack of the hardening review, each failing closed); `make test`
# keeps the chaos suite's short subset (tests marked chaos_short, ~50 s) and the hostile suites.
test: $(STAMP) $(HELM_STAMP) $(LOADTEST_STAMP) $(SYSDEPS) $(DOCKERDEPS) $(VLLM_STAMP)
	KVGATE_VLLM_VENV=$(abspath $(VLLM_VENV)) $(BIN)/pytest -q -p no:cacheprovider -m "not chaos" $(PYTEST_ARGS)

chaos: $(STAMP) $(SYSDEPS)
	$(BIN)/pytest -q -p no:cacheprovider -m "chaos or chaos_short" tests/chaos $(PYTEST_ARGS)
	$(BIN)/pytest -q -p no:cacheprovider tests/test_hostile_*.py tests/test_redis_acl.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
