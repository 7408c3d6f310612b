#!/bin/sh
# Build kvgate's image (`make image`). BuildKit is needed (the pip CA bundle is a build secret and
# pip's cache a cache mount): a client with the buildx plugin, or Debian's docker.io (20.10),
# whose client drives the daemon's built-in BuildKit.
#
# Environment: IMAGE (the tag to build), BASE_IMAGE (empty: a Debian base made here by
# image/debian-base.sh, for machines that reach no image registry), PIP_CERT (a CA bundle for pip
# inside the build, for networks whose TLS is intercepted), PIP_INDEX_URL (another package index),
# DOCKER (the client).
set -eu
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:?set IMAGE, e.g. kvgate:0.1.0}
LOCAL_BASE=kvgate-base:bookworm

if [ -z "${DOCKER:-}" ]; then
  # Newer clients without buildx refuse BuildKit builds; the packaged 20.10 client needs no plugin.
  for c in docker /usr/bin/docker; do
    if $c buildx version >/dev/null 2>&1 ||
      [ "$($c version -f '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)" -lt 23 ] 2>/dev/null; then
      DOCKER=$c
      break
    fi
  done
  [ -n "${DOCKER:-}" ] || { echo "no docker client that can build with BuildKit (install buildx or docker.io)" >&2; exit 1; }
fi
export DOCKER

if [ -z "${BASE_IMAGE:-}" ]; then
  BASE_IMAGE=$LOCAL_BASE
  image/debian-base.sh "$BASE_IMAGE"
fi

set -- --build-arg "BASE_IMAGE=$BASE_IMAGE" --tag "$IMAGE"
if [ -n "${PIP_CERT:-}" ]; then
  set -- "$@" --secret "id=pip_cert,src=$PIP_CERT"
fi
if [ -n "${PIP_INDEX_URL:-}" ]; then
  set -- "$@" --build-arg "PIP_INDEX_URL=$PIP_INDEX_URL"
fi
DOCKER_BUILDKIT=1 $DOCKER build --progress=plain "$@" .
echo "built $IMAGE ($($DOCKER image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'), base $BASE_IMAGE)"
