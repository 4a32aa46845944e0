"""docker/Dockerfile.cpu built and run: `rlink doctor` inside it, a learner and actors in
separate containers on a Docker network, and docker/compose.yaml brought up.

Needs a running Docker engine. ``TEST_DOCKER_IMAGE`` names an image already built (CI's
ci/docker-check.sh builds ``rlink-ucx:cpu`` and sets it); without it the tests build
``rlink-ucx:cpu`` themselves (Docker's layer cache makes a rebuild of an unchanged tree quick),
which needs a local base image with Python 3 (no registry is assumed): ``TEST_DOCKER_BASE``, else
``rlink-base:bookworm`` (the one ci/docker-check.sh makes) or ``python:3.11-slim``, whichever is
there. pip installs from ``TEST_DOCKER_PIP_ARGS``, else from the wheelhouse docker/wheels/ when
it holds torch (docker/wheels/README.md). Skipped, with the reason, when any of these is missing;
ci/docker-check.sh counts a skip as a failure.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("TEST_DOCKER_IMAGE")  # built already (ci/docker-check.sh); else built here
TAG = "rlink-ucx:cpu"
BASES = ("rlink-base:bookworm", "python:3.11-slim")
MiB = 1 << 20
STEPS = 2000  # per actor
# an actor's last line: a flush that the learner answers by closing, once it has all the steps
# it expects, is a Closed after the steps were delivered (the summary checks them)
SENT = rf"(?m)^(actor sent|actor: the learner finished after) {STEPS} steps"


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def local_image(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True, timeout=30).returncode == 0


def base_image() -> str:
    named = os.environ.get("TEST_DOCKER_BASE")
    if named:
        return named
    return next((b for b in BASES if local_image(b)), BASES[0])


def why_not() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (docker info failed); ci/docker-check.sh starts one"
    if IMAGE:
        return None if local_image(IMAGE) else f"TEST_DOCKER_IMAGE={IMAGE!r} is not a local image"
    if not local_image(base := base_image()):
        return (
            f"no local base image {base!r} (set TEST_DOCKER_BASE to a local image with python3, or run "
            "ci/docker-check.sh, which makes rlink-base:bookworm)"
        )
    if not os.environ.get("TEST_DOCKER_PIP_ARGS") and not list((ROOT / "docker/wheels").glob("torch-*.whl")):
        return "no wheelhouse in docker/wheels/ and no TEST_DOCKER_PIP_ARGS (docker/wheels/README.md)"
    return None


REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def image():
    if IMAGE:
        yield IMAGE
        return
    pip_args = os.environ.get("TEST_DOCKER_PIP_ARGS", "--no-index --find-links /wheels")
    # DOCKER_BUILDKIT=0: the classic builder, part of every engine (BuildKit needs buildx here).
    proc = subprocess.run(["docker", "build", "-f", "docker/Dockerfile.cpu", "--build-arg", f"BASE={base_image()}",
                           "--build-arg", f"PIP_ARGS={pip_args}", "-t", TAG, "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "0"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    yield TAG


def learner_summary(container: str) -> dict:
    """The JSON that examples/deploy/learner.py --summary /tmp/summary.json wrote, from the
    stopped container (docker cp streams a tar)."""
    tar = subprocess.run(["docker", "cp", f"{container}:/tmp/summary.json", "-"], capture_output=True, timeout=60)
    assert tar.returncode == 0, tar.stderr.decode(errors="replace")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
        return json.load(tf.extractfile("summary.json"))


def assert_delivered(summary: dict, actors: int) -> None:
    assert summary["steps"] == actors * STEPS and summary["complete"] and summary["in_order"], summary
    assert sorted(summary["per_actor"].values()) == [STEPS] * actors, summary
    assert summary["transports"] == ["tcp"], summary  # separate containers: no shm plane


@pytest.mark.timeout(300)
def test_the_image_runs_as_a_non_root_user(image):
    assert docker("image", "inspect", image, "--format", "{{.Config.User}}").stdout.strip() == "rlink"
    ids = docker("run", "--rm", image, "id", "-u", "-n").stdout.split()
    assert ids == ["rlink"], ids
    assert docker("run", "--rm", image, "id", "-u").stdout.strip() == "10001"
    # and it has what the entry scripts need: rlink_ucx and torch (the CPU build) in its venv
    probe = "import rlink_ucx, torch, sys; print(sys.prefix, torch.__version__, torch.cuda.is_available())"
    out = docker("run", "--rm", image, "python", "-c", probe).stdout
    prefix, version, cuda = out.split()
    assert prefix == "/opt/rlink" and version.endswith("+cpu") and cuda == "False", out


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
               "examples/deploy/learner.py", "--listen", "0.0.0.0:8443", "--expect-steps", str(2 * STEPS),
               "--summary", "/tmp/summary.json")  # fmt: skip
        for name in names[1:]:
            docker("run", "-d", "--name", name, "--network", net, "-e", f"RLINK_TOKEN={token}", "-e",
                   f"RLINK_ADDRESS={names[0]}:8443", image, "python", "examples/deploy/actor.py", "--steps", str(STEPS))  # fmt: skip
        codes = docker("wait", *names, timeout=180).stdout.split()
        logs = {n: docker("logs", n).stdout + docker("logs", n).stderr for n in names}
        assert codes == ["0", "0", "0"], logs
        assert f"{2 * STEPS} steps from 2 actors over tcp" in logs[names[0]], logs
        assert "exactly once: True" in logs[names[0]], logs
        for name in names[1:]:
            assert "over tcp" in logs[name] and re.search(SENT, logs[name]), logs
        assert_delivered(learner_summary(names[0]), actors=2)
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
                                                "--expect-steps", str(2 * STEPS), "--summary", "/tmp/summary.json"]},
        "actor": {"image": image, "command": ["python", "examples/deploy/actor.py", "--steps", str(STEPS)]}}}))  # fmt: skip
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
        assert f"{2 * STEPS} steps from 2 actors over tcp" in logs and "exactly once: True" in logs, logs
        for actor in ids["actor"]:
            assert re.search(SENT, docker("logs", actor).stdout), docker("logs", actor).stdout
        assert_delivered(learner_summary(ids["learner"][0]), actors=2)
    finally:
        subprocess.run([*base, "down", "-v"], capture_output=True, timeout=120, env=env)
        if made:
            env_file.unlink()
