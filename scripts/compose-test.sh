#!/usr/bin/env bash
# The compose integration test (compose.yaml, profile `cpu`), end to end:
# prepare what is missing, build the image, then run the stack
# (scripts/compose_run.py): a Mooncake master, four daemons (--tp 4 --cp 2)
# in their own containers, a driver that replays a trace slice through their
# sockets; one daemon container killed; the survivors must name it; the
# stack down, nothing left running.
#
#   scripts/compose-test.sh [--json-out FILE] [--requests N] [--keep]   (make compose-test)
#
# Idempotent preparation, each step only when needed:
#   - Debian's podman, runc, podman-compose and debootstrap (as root, with apt-get)
#   - /etc/containers/containers.conf: runc, the cgroupfs manager and no
#     default ulimits (this machine kind's sandbox refuses to raise
#     RLIMIT_NPROC and has hybrid cgroups); written only when absent
#   - the base image localhost/cpcache-base:bookworm: `debootstrap --variant=minbase
#     bookworm` imported with `podman import` (no registry is reachable)
#   - the wheelhouse services/cpcached/wheelhouse/: the CPU build of torch,
#     from this machine's local wheel store (pip's find-links), not PyPI's
#     multi-GB CUDA build; and pip's CA bundle when pip is told to use one
#     (PyPI reached through a TLS-inspecting proxy)
#   - the image localhost/cpcache:cpu (`podman-compose build cpu-rank-0`;
#     podman's layer cache makes it quick when only the code changed)
# Environment: CPCACHE_COMPOSE_NO_BUILD=1 skips the build (the image must exist).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=localhost/cpcache-base:bookworm
IMAGE=localhost/cpcache:cpu
WHEELHOUSE=services/cpcached/wheelhouse
PROJECT=${CPCACHE_COMPOSE_PROJECT:-cpcache}
TORCH_PIN=$(sed -n 's/^TORCH_PIN ?= *//p' Makefile)
PACKAGES="podman runc podman-compose debootstrap"

say() { echo "compose-test: $*" >&2; }
is_root() { [ "$(id -u)" = 0 ]; }

missing=""
for p in $PACKAGES; do command -v "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if is_root && command -v apt-get >/dev/null; then
    say "installing$missing (Debian's packages)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES >/dev/null
  else
    say "missing$missing: install them (apt-get install $PACKAGES) or run this as root"; exit 3
  fi
fi

if [ ! -e /etc/containers/containers.conf ]; then
  if is_root; then
    say "writing /etc/containers/containers.conf (runc, cgroupfs, no default ulimits)"
    mkdir -p /etc/containers
    cat > /etc/containers/containers.conf <<'EOF'
# Written by cpcache's scripts/compose-test.sh. This machine kind's sandbox
# refuses to raise RLIMIT_NPROC and has hybrid cgroups.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
  else
    say "no /etc/containers/containers.conf; if containers fail to start, see this script's header"
  fi
fi

if ! podman image exists "$BASE_IMAGE"; then
  is_root || { say "building $BASE_IMAGE needs root (debootstrap)"; exit 3; }
  rootfs=$(mktemp -d /var/tmp/cpcache-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  say "building $BASE_IMAGE: debootstrap --variant=minbase bookworm"
  started=$SECONDS
  debootstrap --variant=minbase bookworm "$rootfs" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
  tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
  say "base image built in $((SECONDS - started)) s"
fi

mkdir -p "$WHEELHOUSE"
version=${TORCH_PIN#torch==}
if ! ls "$WHEELHOUSE"/torch-"$version"*.whl >/dev/null 2>&1; then
  py=.venv/bin/python; [ -x "$py" ] || py=python3
  say "fetching $TORCH_PIN into $WHEELHOUSE (from the local wheel store)"
  "$py" -m pip download -q "$TORCH_PIN" --no-deps -d "$WHEELHOUSE"
fi
build_args=()
build_s=-1
cert=${PIP_CERT:-$( (.venv/bin/python -m pip config get global.cert || python3 -m pip config get global.cert) 2>/dev/null || true)}
if [ -n "$cert" ] && [ -r "$cert" ]; then
  cmp -s "$cert" "$WHEELHOUSE/ca-certificates.crt" || cp "$cert" "$WHEELHOUSE/ca-certificates.crt"
  build_args=(--build-arg PIP_CERT=/context/wheelhouse/ca-certificates.crt)
fi

if [ "${CPCACHE_COMPOSE_NO_BUILD:-0}" != 1 ]; then
  say "building $IMAGE"
  started=$SECONDS
  podman-compose -p "$PROJECT" -f compose.yaml build "${build_args[@]}" cpu-rank-0 >/tmp/cpcache-compose-build.$$.log 2>&1 \
    || { tail -40 /tmp/cpcache-compose-build.$$.log >&2; exit 1; }
  rm -f /tmp/cpcache-compose-build.$$.log
  build_s=$((SECONDS - started))
  say "image built in $build_s s"
fi

exec python3 scripts/compose_run.py --project "$PROJECT" --build-s "$build_s" "$@"
