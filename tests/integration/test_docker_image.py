"""docker/Dockerfile.cpu built and run: `rlink doctor` inside it, a learner and actors in
separate containers on a Docker network, and docker/compose.yaml brought up.

Needs a running Docker engine and a local base image with Python 3 (no registry is assumed):
``TEST_DOCKER_BASE`` names it (default ``python:3.11-slim``). pip installs from
``TEST_DOCKER_PIP_ARGS``, else from the wheelhouse docker/wheels/ when it holds torch
(docker/wheels/README.md). Skipped, with the reason, when any of these is missing.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = os.environ.get("TEST_DOCKER_BASE", "python:3.11-slim")
MiB = 1 << 20


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def why_not() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (docker info failed)"
    if subprocess.run(["docker", "image", "inspect", BASE], capture_output=True, timeout=30).returncode != 0:
        return f"no local base image {BASE!r} (set TEST_DOCKER_BASE to a local image with python3)"
    if not os.environ.get("TEST_DOCKER_PIP_ARGS") and not list((ROOT / "docker/wheels").glob("torch-*.whl")):
        return "no wheelhouse in docker/wheels/ and no TEST_DOCKER_PIP_ARGS (docker/wheels/README.md)"
    return None


REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def image():
    tag = f"rlink-ucx:test-{uuid.uuid4().hex[:8]}"
    pip_args = os.environ.get("TEST_DOCKER_PIP_ARGS", "--no-index --find-links /wheels")
    # DOCKER_BUILDKIT=0: the classic builder, part of every engine (BuildKit needs buildx here).
    proc = subprocess.run(["docker", "build", "-f", "docker/Dockerfile.cpu", "--build-arg", f"BASE={BASE}",
                           "--build-arg", f"PIP_ARGS={pip_args}", "-t", tag, "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "0"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    yield tag
    docker("rmi", "-f", tag, check=False)


@pytest.mark.timeout(900)
def test_doctor_in_the_image_flags_dockers_small_dev_shm(image):
    small = json.loads(docker("run", "--rm", image, "rlink", "doctor", "--json").stdout)
    roomy = json.loads(docker("run", "--rm", "--shm-size", "1g", image, "rlink", "doctor", "--json").stdout)
    assert small["checks"]["shm"]["size_bytes"] == 64 * MiB and small["checks"]["shm"]["status"] == "warn"
    assert "--shm-size" in small["checks"]["shm"]["advice"]
    assert roomy["checks"]["shm"]["size_bytes"] == 1024 * MiB and roomy["checks"]["shm"]["status"] == "ok"
    assert roomy["checks"]["cuda"]["torch"] and roomy["checks"]["nofile"]["status"] in ("ok", "warn")


@pytest.mark.timeout(900)
def test_learner_and_actors_in_separate_containers(image):
    tag = uuid.uuid4().hex[:8]
    net, names = f"rlink-{tag}", [f"rlink-{tag}-{role}" for role in ("learner", "actor1", "actor2")]
    token = "docker-" + uuid.uuid4().hex
    docker("network", "create", net)
    try:
        docker("run", "-d", "--name", names[0], "--network", net, "-e", f"RLINK_TOKEN={token}", image, "python",
               "examples/deploy/learner.py", "--listen", "0.0.0.0:8443", "--expect-steps", "4000")  # fmt: skip
        for name in names[1:]:
            docker("run", "-d", "--name", name, "--network", net, "-e", f"RLINK_TOKEN={token}", "-e",
                   f"RLINK_ADDRESS={names[0]}:8443", image, "python", "examples/deploy/actor.py", "--steps", "2000")  # fmt: skip
        codes = docker("wait", *names, timeout=180).stdout.split()
        logs = {n: docker("logs", n).stdout + docker("logs", n).stderr for n in names}
        assert codes == ["0", "0", "0"], logs
        assert "4000 steps from 2 actors over tcp" in logs[names[0]] and "exactly once: True" in logs[names[0]], logs
    finally:
        docker("rm", "-f", *names, check=False)
        docker("network", "rm", net, check=False)


def compose_command() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0:
            return cmd
    return None


@pytest.mark.timeout(900)
def test_compose_file_brings_up_a_learner_and_actors(image, tmp_path):
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    override = tmp_path / "override.yaml"  # the test image, and runs that end: 2 x 2000 steps
    override.write_text(json.dumps({"services": {
        "learner": {"image": image, "command": ["python", "examples/deploy/learner.py", "--listen", "0.0.0.0:8443",
                                                "--expect-steps", "4000"]},
        "actor": {"image": image, "command": ["python", "examples/deploy/actor.py", "--steps", "2000"]}}}))  # fmt: skip
    env_file = ROOT / "docker" / "rlink.env"
    made = not env_file.exists()
    if made:
        env_file.write_text(f"RLINK_TOKEN=compose-{uuid.uuid4().hex}\n")
        env_file.chmod(0o600)
    project = f"rlinktest{uuid.uuid4().hex[:8]}"
    base = [*cmd, "-f", str(ROOT / "docker/compose.yaml"), "-f", str(override), "-p", project]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # a container gets no more than the engine has
    nofile = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    env = {**os.environ, "RLINK_HOST_PORT": "0", "RLINK_NOFILE": str(nofile)}
    try:
        up = subprocess.run([*base, "up", "-d", "--no-build", "--scale", "actor=2"], capture_output=True, text=True,
                            timeout=300, env=env)  # fmt: skip
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        ids = {role: subprocess.run([*base, "ps", "-a", "-q", role], capture_output=True, text=True, timeout=60,
                                    env=env).stdout.split() for role in ("learner", "actor")}  # fmt: skip
        assert len(ids["learner"]) == 1 and len(ids["actor"]) == 2, ids
        codes = docker("wait", *ids["learner"], *ids["actor"], timeout=180).stdout.split()
        logs = docker("logs", ids["learner"][0]).stdout
        assert codes == ["0", "0", "0"], logs
        assert "4000 steps from 2 actors over tcp" in logs and "exactly once: True" in logs, logs
    finally:
        subprocess.run([*base, "down", "-v"], capture_output=True, timeout=120, env=env)
        if made:
            env_file.unlink()
