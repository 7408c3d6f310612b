#!/bin/sh
# Make a Debian base image without any image registry: debootstrap a minimal bookworm root from a
# Debian mirror and `docker import` it. The root is cached as a tarball keyed by its inputs (suite,
# mirrors, this script), so only the first run pays for debootstrap (~40 s-1.5 min); later runs
# import the cached tarball, or do nothing when the image already carries the same key.
#
#   image/debian-base.sh NAME        e.g. kvgate-base:bookworm
#
# Environment: DOCKER (client, default docker), SUITE (bookworm), MIRROR and SECURITY_MIRROR
# (default: the ones in this machine's apt sources, else deb.debian.org), CACHE_DIR
# (/var/cache/kvgate-image). Needs root and debootstrap.
set -eu

NAME=${1:?usage: debian-base.sh NAME}
DOCKER=${DOCKER:-docker}
SUITE=${SUITE:-bookworm}
CACHE_DIR=${CACHE_DIR:-/var/cache/kvgate-image}

# The first http(s) URI of a Debian archive in the machine's apt sources (deb822 or one-line form).
apt_uri() {  # $1: archive path suffix to match, e.g. "/debian" or "/debian-security"
  cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    grep -v '^[[:space:]]*#' | grep -Eo 'https?://[^[:space:]]+' | grep -E "$1/?\$" | head -n 1
}
MIRROR=${MIRROR:-$(apt_uri /debian || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-$(apt_uri /debian-security || true)}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}

KEY=$( (echo "$SUITE $MIRROR $SECURITY_MIRROR"; cat "$0") | sha256sum | cut -c1-16)
if [ "$($DOCKER image inspect -f '{{index .Config.Labels "org.kvgate.base-key"}}' "$NAME" 2>/dev/null || true)" = "$KEY" ]; then
  echo "base image $NAME is current (key $KEY)"
  exit 0
fi

TARBALL=$CACHE_DIR/debian-$SUITE-minbase-$KEY.tar
if [ ! -f "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
  mkdir -p "$CACHE_DIR"
  ROOT=$(mktemp -d "$CACHE_DIR/root.XXXXXX")
  trap 'rm -rf "$ROOT"' EXIT
  echo "debootstrap $SUITE from $MIRROR (cached as $TARBALL)"
  debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 ||
    { tail -n 20 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
  rm -f "$ROOT.log"
  cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  # What Debian's own container images do: no recommends, no docs or man pages, no apt caches.
  echo 'APT::Install-Recommends "false";' >"$ROOT/etc/apt/apt.conf.d/90container"
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' >"$ROOT/etc/dpkg/dpkg.cfg.d/90container"
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/dev/* "$ROOT"/proc/* "$ROOT"/sys/*
  tar -C "$ROOT" --numeric-owner -cf "$TARBALL.part" .
  mv "$TARBALL.part" "$TARBALL"
fi

$DOCKER import --change "LABEL org.kvgate.base-key=$KEY" --change 'CMD ["/bin/bash"]' "$TARBALL" "$NAME" >/dev/null
echo "imported $NAME from $TARBALL"
