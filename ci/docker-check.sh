#!/usr/bin/env bash
# The Docker check that CI runs (.ci/run): builds docker/Dockerfile.cpu as rlink-ucx:cpu and runs
# tests/integration/test_docker_image.py against it. For a fresh Debian machine, as root, that
# reaches the package registries (PyPI, Debian) but no image registry:
#   1. engine   install docker.io (+ docker-compose, iptables) with apt when dockerd is missing
#   2. daemon   start dockerd in the background (log: $CACHE/dockerd.log) unless `docker info`
#               answers; wait at most DOCKERD_WAIT seconds for it
#   3. base     the base image $BASE (rlink-base:bookworm): kept by tag; made only when absent,
#               with debootstrap (minbase Debian 12 + python3, python3-venv) and `docker import`
#   4. wheels   the wheelhouse for an offline build, from this host's pip with
#               ci/constraints-cpu.txt (the CPU torch), only what the image installs (the
#               build requirements, the dependencies and the torch extra of pyproject.toml); kept
#               in $CACHE/wheels, downloaded only when an offline resolve from it fails, then
#               linked into docker/wheels/
#   5. build    docker build -f docker/Dockerfile.cpu -t rlink-ucx:cpu (its build stage tagged
#               rlink-ucx:cpu-build); classic builder, its layer cache: unchanged dependencies
#               are not reinstalled; then prunes the untagged images of earlier builds
#   6. test     pytest on tests/integration/test_docker_image.py with TEST_DOCKER_IMAGE set;
#               fails when a test fails, errors, or is SKIPPED, or when none ran (junit xml)
# Each step has a time limit (timeout(1)), so a hung mirror cannot eat CI's 90 minutes.
# Exit status 0 only when every step passed. Under CI=true it stops the dockerd it started.
#
# Variables: RLINK_DOCKER_CACHE (default /var/cache/rlink-docker-check), DOCKER_CHECK_BASE
# (default rlink-base:bookworm), DOCKER_CHECK_IMAGE (default rlink-ucx:cpu), DEBIAN_MIRROR,
# PYTHON (the interpreter for pip and pytest; default python3), DOCKER_CHECK_KEEP_DAEMON=1.
#
# Times on this project's machines (2 cores; docs/deploy/README.md): about 6-7 min on a fresh
# machine (the engine, debootstrap, the wheels, torch installed in the build), about 1 min warm.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
CACHE=${RLINK_DOCKER_CACHE:-/var/cache/rlink-docker-check}
BASE=${DOCKER_CHECK_BASE:-rlink-base:bookworm}
IMAGE=${DOCKER_CHECK_IMAGE:-rlink-ucx:cpu}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
DOCKERD_WAIT=${DOCKERD_WAIT:-60}
START=$SECONDS
STARTED_DOCKERD=
mkdir -p "$CACHE" || exit 1
LOGS=$(mktemp -d /tmp/docker-check.XXXXXX)

say() { echo "docker-check [$((SECONDS - START))s] $*"; }
fail() {
  echo "docker-check: FAILED: $*" >&2
  stop_daemon
  exit 1
}
# show_log FILE: the end of a step's log, on failure
show_log() { echo "--- last lines of $1 ---" >&2; tail -n 40 "$1" >&2; }
stop_daemon() {
  if [ -n "$STARTED_DOCKERD" ] && [ "${CI:-}" = true ] && [ "${DOCKER_CHECK_KEEP_DAEMON:-}" != 1 ]; then
    say "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
  fi
}

# --- 1. engine ---------------------------------------------------------------------------
t=$SECONDS
pkgs=()
command -v dockerd >/dev/null || pkgs+=(docker.io iptables)
command -v docker >/dev/null || pkgs+=(docker.io)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  pkgs+=(docker-compose)
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! command -v debootstrap >/dev/null; then
  # (docker image inspect fails without a daemon too: then debootstrap is installed in case)
  pkgs+=(debootstrap)
fi
if [ ${#pkgs[@]} -gt 0 ]; then
  say "engine: apt-get install ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 600 apt-get update -q && timeout 900 apt-get install -y -q --no-install-recommends "${pkgs[@]}"; } > "$LOGS/apt.log" 2>&1 \
    || { show_log "$LOGS/apt.log"; fail "apt-get install ${pkgs[*]}"; }
fi
say "engine: ready in $((SECONDS - t))s ($(dockerd --version 2>/dev/null))"

# --- 2. daemon ---------------------------------------------------------------------------
t=$SECONDS
if docker info >/dev/null 2>&1; then
  say "daemon: a Docker engine answers already"
else
  say "daemon: starting dockerd (log: $CACHE/dockerd.log)"
  # setsid + no inherited descriptors: it outlives this script without holding CI's output.
  setsid dockerd > "$CACHE/dockerd.log" 2>&1 < /dev/null &
  STARTED_DOCKERD=$!
  until docker info >/dev/null 2>&1; do
    if ! kill -0 "$STARTED_DOCKERD" 2>/dev/null; then
      show_log "$CACHE/dockerd.log"
      STARTED_DOCKERD=
      fail "dockerd exited"
    fi
    if ((SECONDS - t > DOCKERD_WAIT)); then
      show_log "$CACHE/dockerd.log"
      fail "no answer from dockerd within ${DOCKERD_WAIT}s"
    fi
    sleep 1
  done
  say "daemon: dockerd answers after $((SECONDS - t))s ($(docker info --format '{{.ServerVersion}}, {{.Driver}}'))"
fi

# --- 3. base image -----------------------------------------------------------------------
t=$SECONDS
if docker image inspect "$BASE" >/dev/null 2>&1; then
  say "base: $BASE is there"
else
  command -v debootstrap >/dev/null || {
    timeout 600 apt-get install -y -q --no-install-recommends debootstrap > "$LOGS/apt2.log" 2>&1 \
      || { show_log "$LOGS/apt2.log"; fail "apt-get install debootstrap"; }
  }
  rootfs=$(mktemp -d /var/tmp/rlink-base.XXXXXX)
  say "base: debootstrap bookworm into $rootfs (from $MIRROR)"
  timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$MIRROR" \
    > "$LOGS/debootstrap.log" 2>&1 || { show_log "$LOGS/debootstrap.log"; rm -rf "$rootfs"; fail "debootstrap"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$BASE" > /dev/null \
    || { rm -rf "$rootfs"; fail "docker import"; }
  rm -rf "$rootfs"
  docker run --rm "$BASE" python3 -c 'import ensurepip, venv' || fail "the base image has no python3 with venv"
  say "base: $BASE made in $((SECONDS - t))s"
fi

# --- 4. wheelhouse -----------------------------------------------------------------------
t=$SECONDS
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || fail "$PYTHON is not Python 3.11 (the base image's): the wheels it picks would not fit"
req=$CACHE/requirements.txt
"$PYTHON" - > "$req" <<'EOF' || fail "reading pyproject.toml"
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(p["build-system"]["requires"] + p["project"]["dependencies"] + p["project"]["optional-dependencies"]["torch"]))
EOF
mkdir -p "$CACHE/wheels"
pip_flags=(--only-binary :all: -c ci/constraints-cpu.txt -r "$req")
# resolve: what an offline install from $CACHE/wheels would take (a JSON report), or fail
resolve() {
  "$PYTHON" -m pip install -q --dry-run --ignore-installed --no-index --find-links "$CACHE/wheels" \
    --report "$LOGS/wheels.json" "${pip_flags[@]}" > "$LOGS/wheels-resolve.log" 2>&1
}
if resolve; then
  say "wheels: $CACHE/wheels satisfies $(tr '\n' ' ' < "$req")"
else
  say "wheels: pip download into $CACHE/wheels"
  timeout 1200 "$PYTHON" -m pip download -d "$CACHE/wheels" "${pip_flags[@]}" > "$LOGS/wheels.log" 2>&1 \
    || { show_log "$LOGS/wheels.log"; fail "pip download"; }
  resolve || { show_log "$LOGS/wheels-resolve.log"; fail "resolving from $CACHE/wheels after the download"; }
fi
# The resolved set alone goes into docker/wheels (the cache may hold older versions too),
# hard-linked where it can be: the same bytes give the build the same layer cache.
rm -f docker/wheels/*.whl
"$PYTHON" - "$LOGS/wheels.json" > "$LOGS/wheels.txt" <<'EOF' || fail "reading pip's report"
import json, sys, urllib.parse, urllib.request
for item in json.load(open(sys.argv[1]))["install"]:
    print(urllib.request.url2pathname(urllib.parse.urlparse(item["download_info"]["url"]).path))
EOF
while read -r whl; do
  ln -f "$whl" docker/wheels/ 2>/dev/null || cp "$whl" docker/wheels/ || fail "copying $whl"
done < "$LOGS/wheels.txt"
say "wheels: $(ls docker/wheels/*.whl | wc -l) wheels in docker/wheels/ ($(du -shL docker/wheels | cut -f1)) in $((SECONDS - t))s"

# --- 5. build ----------------------------------------------------------------------------
t=$SECONDS
say "build: $IMAGE from docker/Dockerfile.cpu on $BASE (log: $LOGS/build.log)"
# The build stage gets a tag too ($IMAGE-build): untagged, it would look unused to the prune below.
for target in build final; do
  if [ $target = build ]; then args=(--target build -t "$IMAGE-build"); else args=(-t "$IMAGE"); fi
  DOCKER_BUILDKIT=0 timeout 1800 docker build -f docker/Dockerfile.cpu --build-arg "BASE=$BASE" \
    --build-arg "PIP_ARGS=--no-index --find-links /wheels" "${args[@]}" . >> "$LOGS/build.log" 2>&1 \
    || { show_log "$LOGS/build.log"; fail "docker build ($target)"; }
done
# What a rebuild replaced (untagged now, of this Dockerfile): no cache of anything still used.
docker image prune -f --filter label=org.rlink.image=cpu > /dev/null 2>&1
say "build: $IMAGE built in $((SECONDS - t))s ($(grep -c 'Using cache' "$LOGS/build.log") steps of 2 builds from the cache;" \
  "$(docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}'))"

# --- 6. tests ----------------------------------------------------------------------------
t=$SECONDS
junit=$LOGS/junit.xml
# pytest from the test environment (.ci/run's venv); from a bare interpreter, a small venv of
# its own in $CACHE/venv (pytest and what tests/conftest.py imports; no torch on the host).
TESTPY=$PYTHON
if ! "$TESTPY" -c 'import pytest, pytest_timeout, numpy, msgspec, xxhash, cryptography' 2>/dev/null; then
  TESTPY=$CACHE/venv/bin/python
  if ! "$TESTPY" -c 'import pytest, pytest_timeout, numpy, msgspec, xxhash, cryptography' 2>/dev/null; then
    say "test: $PYTHON lacks pytest or rlink_ucx's dependencies: making $CACHE/venv"
    { "$PYTHON" -m venv --clear "$CACHE/venv" \
        && "$TESTPY" -m pip install -q pytest pytest-timeout numpy msgspec xxhash cryptography; } > "$LOGS/venv.log" 2>&1 \
      || { show_log "$LOGS/venv.log"; fail "making $CACHE/venv"; }
  fi
fi
say "test: tests/integration/test_docker_image.py on $IMAGE"
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} TEST_DOCKER_IMAGE=$IMAGE TEST_DOCKER_BASE=$BASE \
  TEST_DOCKER_PIP_ARGS="--no-index --find-links /wheels" timeout 1800 "$TESTPY" -m pytest tests/integration/test_docker_image.py -rs -p no:cacheprovider --junitxml "$junit"
pytest_rc=$?
# A skip is a failure here: count from the junit xml, whatever pytest's exit status was.
counts=$("$PYTHON" - "$junit" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"no junit xml ({exc})")
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(", ".join(f"{v} {k}" for k, v in n.items()))
sys.exit(0 if n["tests"] > 0 and n["failures"] == n["errors"] == n["skipped"] == 0 else 1)
EOF
)
counts_rc=$?
say "test: $counts (pytest exit $pytest_rc) in $((SECONDS - t))s"
if [ "$pytest_rc" -ne 0 ] || [ "$counts_rc" -ne 0 ]; then
  fail "the Docker tests: $counts (pytest exit $pytest_rc; a skip counts as a failure here)"
fi
stop_daemon
rm -rf "$LOGS"
say "passed in $((SECONDS - START))s"
