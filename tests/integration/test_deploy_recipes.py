"""The deployment recipes of docs/deploy/ and docker/, run as far as this machine allows.

torchrun and the SLURM script run for real on loopback (SLURM with a stand-in ``srun`` that
starts the tasks here, and no ``scontrol``, so the script's own host-list expansion is used);
the compose file and the Kubernetes manifests are parsed and checked for what matters (the
token from a secret, /dev/shm, ports, the entry scripts) and handed to ``docker compose
config`` / ``kubectl`` where those work offline. The container image is built and run where
a Docker engine and a local base image exist (docs/deploy/README.md says how)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "examples" / "deploy"
sys.path.insert(0, str(DEPLOY))
import launch

STEPS = 3000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLINK_", "SLURM_", "MASTER_", "RANK",
                                                                       "WORLD_SIZE", "LOCAL_"))}  # fmt: skip
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return {**env, **extra}


def check_summary(path: Path, actors: list[str], steps: int) -> dict:
    summary = json.loads(path.read_text())
    assert summary["complete"] and summary["in_order"], summary
    assert summary["steps"] == steps * len(actors) and summary["per_actor"] == {a: steps for a in actors}, summary
    return summary


def check_rank_summaries(summary: Path, learners: int, actors: list[str], steps: int) -> list[dict]:
    """Each learner rank's summary: every actor's steps at exactly one rank, in order, exactly
    once; the actors balanced over the ranks (rank 0 places none before every rank linked, so
    actors that start with the learners are balanced too); the total counted by every rank."""
    got = [json.loads(summary.with_name(f"{summary.stem}.rank{r}.json").read_text()) for r in range(learners)]
    assert [g["rank"] for g in got] == list(range(learners)) and {g["world_size"] for g in got} == {learners}, got
    assert all(g["complete"] and g["in_order"] for g in got), got
    placed = [set(g["per_actor"]) for g in got]
    assert sum(map(len, placed)) == len(actors) and set().union(*placed) == set(actors), got  # one rank each
    assert max(map(len, placed)) - min(map(len, placed)) <= 1, got  # balanced
    assert all(n == steps for g in got for n in g["per_actor"].values()), got
    assert all(g["steps"] == steps * len(g["per_actor"]) for g in got), got
    assert {g["total_steps"] for g in got} == {steps * len(actors)}, got
    assert len({g["address"] for g in got}) == learners, got
    return got


@pytest.mark.timeout(240)
def test_torchrun_recipe_learner_on_rank_0_actors_on_the_others(tmp_path):
    summary = tmp_path / "summary.json"
    port = free_port()
    env = base_env(RLINK_TOKEN="torchrun-" + uuid.uuid4().hex, RLINK_PORT=str(port), NPROC_PER_NODE="3",
                   TORCHRUN=f"{sys.executable} -m torch.distributed.run", OMP_NUM_THREADS="1")  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "docs/deploy/torchrun.sh"), "--steps", str(STEPS), "--summary",
                           str(summary)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "learner for 2 actors at" in out and f":{port}" in out, out[-3000:]
    got = check_summary(summary, ["1", "2"], STEPS)
    assert got["address"] == f"0.0.0.0:{port}"


@pytest.mark.timeout(240)
def test_torchrun_recipe_with_two_learner_ranks_sharing_three_actors(tmp_path):
    summary = tmp_path / "summary.json"
    port = free_port()
    env = base_env(RLINK_TOKEN="torchrun-" + uuid.uuid4().hex, RLINK_PORT=str(port), RLINK_GROUP_PORT=str(free_port()),
                   RLINK_LEARNERS="2", NPROC_PER_NODE="5", TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                   OMP_NUM_THREADS="1")  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "docs/deploy/torchrun.sh"), "--steps", str(STEPS), "--summary",
                           str(summary)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "learner rank 0 of 2" in out and "learner rank 1 of 2" in out and "for 3 actors" in out, out[-3000:]
    got = check_rank_summaries(summary, 2, ["2", "3", "4"], STEPS)
    assert got[0]["address"] == f"0.0.0.0:{port}" and not summary.exists()


@pytest.mark.timeout(240)
def test_learner_only_torchrun_job_with_actors_started_apart(tmp_path):
    """The Kubernetes shape on loopback: a torchrun job of 2 learner ranks (learner.py
    --distributed), then 3 actors given rank 0's address once the ranks are up: balanced."""
    port, summary = free_port(), tmp_path / "summary.json"
    env = base_env(RLINK_TOKEN="learners-" + uuid.uuid4().hex, OMP_NUM_THREADS="1")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(DEPLOY / "learner.py"), "--distributed", "--listen", f"127.0.0.1:{port}",
                            "--expect-steps", str(3 * STEPS), "--batch-size", "200", "--summary", str(summary)],
                           cwd=tmp_path, env=env, stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "learner rank 0 of 2 listening" not in (tmp_path / "job.log").read_text():  # every rank is up
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        procs = [subprocess.Popen([sys.executable, str(DEPLOY / "actor.py"), "--address", f"127.0.0.1:{port}",
                                   "--actor-id", str(i), "--steps", str(STEPS)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
                 for i in (11, 12, 13)]
        outs = [p.communicate(timeout=150)[0] for p in procs]
        assert all(p.returncode == 0 and f"actor sent {STEPS} steps" in o for p, o in zip(procs, outs)), outs
        assert job.wait(timeout=60) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    got = check_rank_summaries(summary, 2, ["11", "12", "13"], STEPS)
    assert sorted(len(g["per_actor"]) for g in got) == [1, 2], got  # balanced: started after the ranks were up


def test_torchrun_recipe_refuses_to_start_without_a_token(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "docs/deploy/torchrun.sh")], env=base_env(TORCHRUN="false"),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2 and "set RLINK_TOKEN or RLINK_TOKEN_FILE" in proc.stderr


FAKE_SRUN = """#!/bin/bash
# Stands in for srun: starts SLURM_NTASKS copies of the command here, as tasks 0..N-1.
while [[ $1 == -* ]]; do shift; done  # srun's own options
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" > "$FAKE_SRUN_LOGS/task$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
"""


@pytest.mark.timeout(240)
def test_slurm_script_with_a_fake_environment_and_no_scontrol(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("scontrol", path=path):
        pytest.skip("scontrol is installed here: the script would not use its fallback")
    port, summary = free_port(), tmp_path / "summary.json"
    env = base_env(PATH=path, SLURM_JOB_ID="4242", SLURM_NTASKS="3", SLURM_JOB_NODELIST="127.0.0.[1-3]",
                   SLURM_SUBMIT_DIR=str(ROOT), RLINK_PORT=str(port), PYTHON=sys.executable,
                   FAKE_SRUN_LOGS=str(tmp_path))  # fmt: skip
    # No token given: the script makes one for the job and hands it to every task.
    proc = subprocess.run(["bash", str(ROOT / "docs/deploy/slurm.sbatch"), "--steps", str(STEPS), "--summary",
                           str(summary)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    logs = {p.name: p.read_text() for p in tmp_path.glob("task*.log")}
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + json.dumps(logs)[-3000:]
    assert f"learner at 127.0.0.1:{port}, 3 tasks" in proc.stdout  # first host of the expanded list
    assert "rank 0 of 3: learner for 2 actors" in logs["task0.log"]
    assert all("actor sent 3000 steps" in logs[f"task{i}.log"] for i in (1, 2)), logs
    check_summary(summary, ["1", "2"], STEPS)


@pytest.mark.timeout(240)
def test_slurm_script_with_two_learner_ranks(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("scontrol", path=path):
        pytest.skip("scontrol is installed here: the script would not use its fallback")
    port, summary = free_port(), tmp_path / "summary.json"
    env = base_env(PATH=path, SLURM_JOB_ID="4243", SLURM_NTASKS="5", SLURM_JOB_NODELIST="127.0.0.[1-3]",
                   SLURM_SUBMIT_DIR=str(ROOT), RLINK_PORT=str(port), RLINK_GROUP_PORT=str(free_port()),
                   RLINK_LEARNERS="2", PYTHON=sys.executable, FAKE_SRUN_LOGS=str(tmp_path), OMP_NUM_THREADS="1")  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "docs/deploy/slurm.sbatch"), "--steps", str(STEPS), "--summary",
                           str(summary)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    logs = {p.name: p.read_text() for p in tmp_path.glob("task*.log")}
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + json.dumps(logs)[-3000:]
    assert f"learner at 127.0.0.1:{port}, 5 tasks (2 learner ranks)" in proc.stdout
    assert all(f"learner rank {r} of 2" in logs[f"task{r}.log"] for r in (0, 1)), logs
    assert all(f"actor sent {STEPS} steps" in logs[f"task{i}.log"] for i in (2, 3, 4)), logs
    check_rank_summaries(summary, 2, ["2", "3", "4"], STEPS)


def test_launch_counts_learner_ranks():
    assert launch.learner_count({}, 4) == 1
    assert launch.learner_count({"RLINK_LEARNERS": "3"}, 4) == 3
    for bad in ("0", "4", "two"):
        with pytest.raises(SystemExit, match="RLINK_LEARNERS"):
            launch.learner_count({"RLINK_LEARNERS": bad}, 4)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node7", ["node7"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a[9-10]", ["a9", "a10"]),
])  # fmt: skip
def test_slurm_host_list_expansion(nodelist, hosts):
    assert launch.expand_nodelist(nodelist) == hosts
    if shutil.which("scontrol"):  # where SLURM exists, the same answer as its own tool
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        assert out.stdout.split() == hosts


def test_launch_reads_torchrun_then_slurm_variables():
    assert launch.rank_and_world({"RANK": "2", "WORLD_SIZE": "4", "SLURM_PROCID": "9", "SLURM_NTASKS": "9"}) == (2, 4)
    assert launch.rank_and_world({"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}) == (1, 3)
    assert launch.learner_address({"MASTER_ADDR": "head", "MASTER_PORT": "29500"}) == "head:8443"
    assert launch.learner_address({"RLINK_ADDRESS": "x:1", "MASTER_ADDR": "head"}) == "x:1"
    assert launch.learner_address({"SLURM_JOB_NODELIST": "n[3-4]", "RLINK_PORT": "9000"}) == "n3:9000"
    with pytest.raises(SystemExit, match="no rank"):
        launch.rank_and_world({})


def _yaml():
    return pytest.importorskip("yaml")


def _token_from_secret(container: dict) -> dict:
    (token,) = [e for e in container["env"] if e["name"] in ("RLINK_TOKEN", "RLINK_TOKEN_FILE")]
    return token["valueFrom"]["secretKeyRef"]


def test_kubernetes_manifests_take_the_token_from_a_secret_and_size_dev_shm():
    docs = {d["kind"]: d for d in _yaml().safe_load_all((ROOT / "docs/deploy/k8s/rlink.yaml").read_text())}
    assert set(docs) == {"Service", "Deployment", "Job"}
    service, learner, actors = docs["Service"], docs["Deployment"], docs["Job"]
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8443 and service["spec"]["selector"] == learner["spec"]["template"]["metadata"]["labels"]
    assert learner["spec"]["replicas"] == 1 and learner["spec"]["strategy"]["type"] == "Recreate"
    for workload in (learner, actors):
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert _token_from_secret(container) == {"name": "rlink-token", "key": "token"}
        shm = {v["name"]: v for v in pod["volumes"]}[next(m["name"] for m in container["volumeMounts"]
                                                           if m["mountPath"] == "/dev/shm")]  # fmt: skip
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert (ROOT / container["command"][1]).is_file(), container["command"]  # the entry script exists
        assert pod["securityContext"]["runAsNonRoot"] is True
    (lc,) = learner["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in lc["ports"]}[port["targetPort"]] == 8443
    assert lc["command"][-1] == "0.0.0.0:8443"
    (ac,) = actors["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in ac["env"]}
    assert env["RLINK_ADDRESS"]["value"] == f"{service['metadata']['name']}:{port['port']}"
    assert actors["spec"]["completionMode"] == "Indexed" and "job-completion-index" in str(env["RLINK_ACTOR_ID"])


def test_kubernetes_many_learners_manifest_makes_an_indexed_learner_job_behind_rank_0():
    docs = list(_yaml().safe_load_all((ROOT / "docs/deploy/k8s/rlink-learners.yaml").read_text()))
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}
    assert set(services) == {"rlink-learner", "rlink-learner-ranks"} and set(jobs) == {"rlink-learners", "rlink-actors"}
    learners, actors, front = jobs["rlink-learners"], jobs["rlink-actors"], services["rlink-learner"]
    spec, pod = learners["spec"], learners["spec"]["template"]["spec"]
    (lc,) = pod["containers"]
    env = {e["name"]: e for e in lc["env"]}
    world = int(env["WORLD_SIZE"]["value"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == world >= 2
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    headless = services[pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert env["MASTER_ADDR"]["value"] == f"{learners['metadata']['name']}-0.{pod['subdomain']}"  # rank 0's pod
    ports = {p["name"]: p["containerPort"] for p in lc["ports"]}
    assert ports["rendezvous"] == int(env["MASTER_PORT"]["value"]) and ports[front["spec"]["ports"][0]["targetPort"]] == 8443
    assert lc["command"][:3] == ["python", "examples/deploy/learner.py", "--distributed"] and lc["command"][-1] == "0.0.0.0:8443"
    assert (ROOT / lc["command"][1]).is_file()
    labels = learners["spec"]["template"]["metadata"]["labels"]
    selector = front["spec"]["selector"]  # actors reach rank 0 only: the pod of completion index 0
    assert selector == {**labels, "batch.kubernetes.io/job-completion-index": "0"}
    assert headless["spec"]["selector"] == labels
    (ac,) = actors["spec"]["template"]["spec"]["containers"]
    aenv = {e["name"]: e for e in ac["env"]}
    assert aenv["RLINK_ADDRESS"]["value"] == f"rlink-learner:{front['spec']['ports'][0]['port']}"
    for container in (lc, ac):
        assert _token_from_secret(container) == {"name": "rlink-token", "key": "token"}
    for job in (learners, actors):
        assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("name", ["rlink.yaml", "rlink-learners.yaml"])
def test_kubernetes_manifests_pass_kubectl(name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    manifest = str(ROOT / "docs/deploy/k8s" / name)
    applied = subprocess.run([kubectl, "apply", "--dry-run=client", "--validate=false", "-f", manifest],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    if applied.returncode == 0:  # a cluster is configured: its schema checked the objects
        assert "rlink-learner" in applied.stdout and "rlink-actors" in applied.stdout
        return
    # No cluster: `kubectl apply` cannot map kinds without one. `set env --local` decodes the
    # workloads into Kubernetes' typed objects (a mistyped field fails) without a server.
    listed = subprocess.run([kubectl, "set", "env", "--local", "-f", manifest, "--list"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("RLINK_TOKEN from secret rlink-token, key token") == 2, listed.stdout
    assert "RLINK_ADDRESS=rlink-learner:8443" in listed.stdout


def test_compose_file_passes_the_token_by_env_file_and_sizes_dev_shm():
    compose = _yaml().safe_load((ROOT / "docker/compose.yaml").read_text())
    learner, actor = compose["services"]["learner"], compose["services"]["actor"]
    for service in (learner, actor):
        assert service["env_file"] == ["rlink.env"] and service["shm_size"] == "1gb"
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cpu"
        assert (ROOT / "docker" / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert (ROOT / service["command"][1]).is_file(), service["command"]
        assert "RLINK_TOKEN" not in str(service.get("environment", {}))  # never inline
    assert learner["command"][-1] == "0.0.0.0:8443" and learner["ports"][0].startswith("127.0.0.1:")
    assert learner["ports"][0].endswith(":8443") and actor["environment"]["RLINK_ADDRESS"] == "learner:8443"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "docker/rlink.env" in ignored


def compose_command() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0:
            return cmd
    return None


def test_compose_config_validates(tmp_path):
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    env_file = ROOT / "docker" / "rlink.env"
    made = not env_file.exists()
    if made:  # config needs the env file; a throwaway token, removed afterwards
        env_file.write_text(f"RLINK_TOKEN=compose-{uuid.uuid4().hex}\n")
        env_file.chmod(0o600)
    try:
        out = subprocess.run([*cmd, "-f", str(ROOT / "docker/compose.yaml"), "config"], capture_output=True,
                             text=True, timeout=60, env=base_env(RLINK_HOST_PORT="18443"))  # fmt: skip
    finally:
        if made:
            env_file.unlink()
    assert out.returncode == 0, out.stderr
    config = _yaml().safe_load(out.stdout)
    assert {"learner", "actor"} <= set(config["services"])
    assert all("RLINK_TOKEN" in s["environment"] for s in config["services"].values())  # from the env file
    assert "18443" in str(config["services"]["learner"]["ports"])
