#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (the device tool's nvidia-h200):
#   bash ci/gpu-wheels.sh                                         # here, once: fills .whl/
#   run(command="bash ci/gpu-check.sh", carry=[".whl"], timeout_s=540)
# Results land in $OUT (or bench-results/gpu). The device tool brings back at most 8 files
# from $OUT, so these 8 are all there is (logs and scratch files go to a temporary folder):
#   summary.txt / .json   every step: ok | failed | timed out | skipped-no-cuda | skipped,
#                         its time and limit, the file it wrote; the targets where measured
#   env.txt               nvidia-smi, Python packages, `rlink info` (UCX transports, auto's pick)
#   logs.txt              each step's output: pytest -rs (skip reasons), the benchmarks' tables
#                         (the GPU tests include the broadcast fan-out on NCCL,
#                         tests/gpu/test_broadcast_nccl.py: Config(weights_fanout="broadcast")
#                         with a CUDA model; on one GPU it checks the fall-back to streams, with
#                         two the versions going by NCCL broadcast)
#   gpu-throughput.json   bench/throughput.py --device cuda:0: rlink planes, CUDA steps -> batches
#                         on the GPU, against a raw socket
#   ucx-d2d.json          bench/ucx_d2d.py: raw ucxx, CUDA buffer -> CUDA buffer between two
#                         processes (the ceiling of the rlink rows above)
#   gpu-latency.json      bench/gpu_latency.py: put -> fetch latency of CUDA steps per plane, and
#                         how long fetch takes for a batch already held
#   fanout.json           bench/fanout.py: learner.publish vs a plain broadcast of the same bytes
#   replay-device.json    rlink bench --suite replay --storage device: uniform sampling from a replay table
#                         kept on the GPU (a device gather)
#
# Time budget (each step has its own `timeout`, plus 5 s to kill what ignores SIGTERM; a step
# never gets more than what is left of TOTAL, so the whole run ends within 8 minutes):
#   wheels 40 + env 25 + gpu-tests 170 + gpu-throughput 140 + ucx-d2d 40 + gpu-latency 45
#   + host-latency 30 + fanout 45 + replay-device 40 = 575 s of limits, more than TOTAL = 470 s: on the H200 the
#   steps took 3, 8, (the tests), 111, 7, 22, -, 11 s, so the caps only matter when one hangs,
#   and then TOTAL still ends the run within 8 minutes; the summary takes ~2 s.
#
# Exit status: 0 when nothing failed. Without CUDA (a CPU machine) the GPU steps report
# skipped-no-cuda and the script still exits 0. With CUDA present, a GPU test that was skipped,
# a plane a benchmark could not run, or a step that failed or ran out of time makes it exit 1,
# with a FAILED line in summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
rm -f "$OUT"/{summary.txt,summary.json,env.txt,logs.txt,gpu-throughput.json,ucx-d2d.json,gpu-latency.json,fanout.json,replay-device.json}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
TOTAL=470
START=$SECONDS
export PYTHONUNBUFFERED=1

# run_step NAME KIND LIMIT FILE CMD...: run CMD with its own time limit (capped by what is left
# of TOTAL), its output appended to logs.txt; KIND tells the summary how to read its exit status.
run_step() {
  local name=$1 kind=$2 limit=$3 file=$4
  shift 4
  local left=$((TOTAL - (SECONDS - START) - 5))
  local log="$WORK/$name.log" rc t0=$SECONDS
  if ((left < 10)); then
    echo "not started: the script's $TOTAL s were spent" > "$log"
    rc=-1
  else
    ((limit > left)) && limit=$left
    echo "$ $*" > "$log"
    timeout -k 5 "$limit" "$@" >> "$log" 2>&1
    rc=$?
  fi
  echo "[$name: exit status $rc after $((SECONDS - t0)) s, limit $limit s]" >> "$log"
  { echo "===== $name"; cat "$log"; echo; } >> "$OUT/logs.txt"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "$rc" "$((SECONDS - t0))" "$limit" "$file" >> "$WORK/steps.tsv"
}

# not_run NAME FILE NOTE: a step this machine cannot run (no CUDA)
not_run() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "not-run:$3" "" 0 0 "$2" >> "$WORK/steps.tsv"
}

# --- wheels: what the GPU image lacks (ucxx for CUDA 13, msgspec), carried in .whl/ ------------
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
  run_step wheels plain 40 "" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
  # exit status 2: only ucxx is missing (a failure only where there is a GPU)
  run_step wheels no-wheels 40 "" python3 -c "import importlib.util as u, sys
missing = [n for n in ('msgspec', 'xxhash', 'cryptography', 'ucxx') if u.find_spec(n) is None]
print('no .whl/ here; missing:', ', '.join(missing) or 'nothing')
sys.exit(1 if set(missing) - {'ucxx'} else 2 if missing else 0)"
fi

# --- env: what this machine is; does torch see the GPU nvidia-smi shows? ----------------------
{
  echo "== $(date -u +%FT%TZ)  $(uname -srm)  $(nproc) CPUs"
  echo "== nvidia-smi"
  timeout 20 nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
} > "$OUT/env.txt"
GPUS_SEEN=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
run_step env plain 25 env.txt python3 -c '
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "cupy", "numpy", "ucxx", "msgspec", "xxhash", "cryptography", "pytest", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(f"{name:15s}", getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:
        print(f"{name:15s} not importable: {e}")
import torch
cuda = torch.cuda.is_available()
print("torch CUDA", cuda, torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if cuda else "", "NCCL", torch.cuda.nccl.version() if cuda else None)
open(sys.argv[1], "w").write(("1\t" + torch.cuda.get_device_name(0) if cuda else "0\t-") + "\n")
' "$WORK/cuda"
{
  cat "$WORK/env.log"
  echo "== rlink info"
  timeout 30 python3 -m rlink_ucx info 2>&1
} >> "$OUT/env.txt"
CUDA=0 GPU_NAME=""
[ -s "$WORK/cuda" ] && IFS=$'\t' read -r CUDA GPU_NAME < "$WORK/cuda"
if [ "${CUDA:-0}" = 1 ]; then
  echo "CUDA: $GPU_NAME"
elif [ "${GPUS_SEEN:-0}" -gt 0 ]; then
  echo "torch sees no CUDA although nvidia-smi lists $GPUS_SEEN GPU(s): the GPU steps fail"
else
  echo "no CUDA: the GPU steps report skipped-no-cuda"
fi

# --- the GPU tests; the summary reads the junit XML: with CUDA, any skipped test is a failure ----
run_step gpu-tests pytest 170 logs.txt python3 -m pytest tests/gpu -v -rs -p no:cacheprovider --durations=0 \
  -o faulthandler_timeout=80 --junitxml="$WORK/gpu-tests.xml"

# --- benchmarks ----------------------------------------------------------------------------------
if [ "${CUDA:-0}" = 1 ]; then
  run_step gpu-throughput plain 140 gpu-throughput.json python3 bench/throughput.py --device cuda:0 \
    --sizes 64K,1M,16M --transports tcp,ucx,shm --reps 2 --steps 20000 --json "$OUT/gpu-throughput.json"
else  # it would spend its time on the raw-socket rows before failing on the missing GPU
  not_run gpu-throughput gpu-throughput.json "needs CUDA (its CPU rows are bench/throughput.py without --device)"
fi
# These two run without CUDA too: they write {"cuda": false, ...} and exit 3.
run_step ucx-d2d cuda-script 40 ucx-d2d.json python3 bench/ucx_d2d.py --device cuda:0 --sizes 64K,1M,16M \
  --reps 3 --total-mib 2048 --json "$OUT/ucx-d2d.json"
run_step gpu-latency cuda-script 45 gpu-latency.json python3 bench/gpu_latency.py --device cuda:0 \
  --transport auto,tcp,ucx,shm --chunks 300 --json "$OUT/gpu-latency.json"
# The same latency with host steps and batches on this machine: which part of a plane's latency
# is CUDA's (the table goes to logs.txt).
run_step host-latency plain 30 "" python3 bench/gpu_latency.py --device cpu --transport tcp,shm \
  --chunks 300 --json "$WORK/host-latency.json"
if [ "${CUDA:-0}" = 1 ]; then
  run_step fanout plain 45 fanout.json python3 bench/fanout.py --reps 3 --device cuda:0 --json "$OUT/fanout.json"
else  # CPU parameters over gloo: measured by the suite on CPU machines already
  not_run fanout fanout.json "run on the GPU machine only (on a CPU machine the suite measures it)"
fi
if [ "${CUDA:-0}" = 1 ]; then  # the replay table kept on the GPU: sampling is a device gather
  run_step replay-device plain 40 replay-device.json python3 -m rlink_ucx bench --suite replay --only uniform --storage device \
    --device cuda:0 --seconds 5 --json "$OUT/replay-device.json"
else
  not_run replay-device replay-device.json "needs CUDA (the host table is measured by rlink bench --suite replay)"
fi

# --- summary ------------------------------------------------------------------------------------
python3 - "$WORK" "$OUT" "${CUDA:-0}" "${GPU_NAME:-}" "${GPUS_SEEN:-0}" "$((SECONDS - START))" "$TOTAL" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET

work, out, cuda, gpu, seen, elapsed, total = sys.argv[1:]
cuda, seen = cuda == "1", int(seen or 0)
expect_cuda = cuda or seen > 0  # a GPU nvidia-smi shows but torch does not see is a failure too
steps, failures = [], []


def load(name):
    try:
        with open(os.path.join(out, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def last_line(step):
    """The step's last line of output (before the exit-status line run_step adds)."""
    try:
        lines = [x.strip() for x in open(os.path.join(work, step + ".log"), errors="replace") if x.strip()]
    except OSError:
        return ""
    return lines[-2][:300] if len(lines) > 1 else ""


def tests_status(rc):
    try:
        root = ET.parse(os.path.join(work, "gpu-tests.xml")).getroot()
    except (OSError, ET.ParseError):
        return "failed", f"pytest wrote no junit XML (exit status {rc})"
    cases = root.findall(".//testcase")
    skipped = [c for c in cases if c.find("skipped") is not None]
    broken = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    reasons = sorted({(c.find("skipped").get("message") or "").strip() for c in skipped})
    counts = f"{len(cases)} tests: {len(cases) - len(skipped) - len(broken)} passed, {len(broken)} failed, {len(skipped)} skipped"
    if broken or rc not in (0, 5):
        names = ", ".join(c.get("name", "?") for c in broken)
        return "failed", f"{counts} (exit status {rc}){': ' + names if names else ''}"
    if not cases:
        return "failed", "pytest collected no GPU test"
    if expect_cuda and skipped:
        return "failed", f"CUDA is present but {len(skipped)} of {len(cases)} GPU tests were skipped: {'; '.join(reasons)}"
    if not expect_cuda and len(skipped) == len(cases):
        return "skipped-no-cuda", counts
    return "ok", counts


for line in open(os.path.join(work, "steps.tsv")):
    name, kind, rc, secs, limit, file = line.rstrip("\n").split("\t")
    note = ""
    if kind.startswith("not-run:"):
        status, note, rc = ("failed", "CUDA is present but the step did not run", None) if expect_cuda else ("skipped-no-cuda", kind[8:], None)
    else:
        rc = int(rc)
        data = load(file) if file.endswith(".json") else None
        if rc == -1:
            status, note = "timed out", f"not started: the {total} s budget was spent"
        elif rc in (124, 137):
            status, note = "timed out", f"killed after its {limit} s limit"
        elif kind == "pytest":
            status, note = tests_status(rc)
        elif kind == "cuda-script" and rc == 3:
            status, note = ("failed", "says no CUDA, but a GPU is there") if expect_cuda else ("skipped-no-cuda", (data or {}).get("error", "no CUDA"))
        elif kind == "no-wheels":
            if rc == 0:
                status, note = "skipped", "no .whl/ needed: msgspec, xxhash, cryptography and ucxx are installed"
            elif rc == 2 and not expect_cuda:
                status, note = "skipped", "no .whl/; ucxx is missing (its steps need CUDA anyway)"
            else:
                status, note = "failed", "no .whl/ here and rlink's packages or ucxx are missing: run ci/gpu-wheels.sh, carry .whl"
        elif rc != 0:
            status = "failed"
            note = (data or {}).get("error") or f"exit status {rc}: {last_line(name)}"
        else:
            status = "ok"
            if kind == "cuda-script" and data is not None:
                skipped = [f"{r['transport']} ({r['skipped']})" for r in data.get("rows", []) if "skipped" in r]
                if skipped and expect_cuda:
                    status, note = "failed", "CUDA is present but planes were skipped: " + ", ".join(skipped)
        if file.endswith(".json") and status == "ok" and data is None:
            status, note = "failed", f"{file} is missing or not JSON"
        if not file.endswith(".json") and status == "ok" and name == "env" and seen and not cuda:
            status, note = "failed", f"nvidia-smi shows {seen} GPU(s) but torch sees no CUDA"
    wrote = file if file and os.path.exists(os.path.join(out, file)) else None
    steps.append({"step": name, "status": status, "exit_status": rc, "seconds": int(secs), "limit_s": int(limit),
                  "file": wrote, "note": note})
    if status in ("failed", "timed out"):
        failures.append(f"{name} {status}: {note}")

# The targets, where both sides were measured (information; they do not fail the check).
targets = {}
tp, d2d, lat, fan = (load(n) for n in ("gpu-throughput.json", "ucx-d2d.json", "gpu-latency.json", "fanout.json"))
if tp and d2d and d2d.get("rows"):
    raw = {r["size"]: r["gbps"] for r in d2d["rows"]}
    for r in tp.get("rows", []):
        size = r["workload"].removeprefix("bytes-")
        if r["workload"].startswith("bytes-") and r["system"].startswith("rlink-") and size in raw and raw[size] > 0:
            targets[f"{r['system']} {size} / raw ucxx d2d"] = {"ratio": r["median"] / raw[size], "rlink_gbps": r["median"],
                                                               "raw_gbps": raw[size], "target": ">= 0.8 at >= 1M"}
if lat:
    for r in lat.get("rows", []):
        if "latency" in r:
            targets[f"put->fetch {r['transport']} ({r['plane']})"] = {
                "p50_us": r["latency"]["p50_us"], "p99_us": r["latency"]["p99_us"],
                "ready_fetch_p50_us": r["ready_fetch"]["p50_us"], "ready_fetch_p99_us": r["ready_fetch"]["p99_us"]}
if fan:
    targets["publish / plain broadcast"] = {"ratio": fan["ratio"], "paired_ratio": fan["paired_ratio"], "target": "<= 1.25"}

ok = not failures
summary = {"result": "ok" if ok else "failed", "cuda": cuda, "gpu": gpu or None, "gpus_seen_by_nvidia_smi": seen,
           "elapsed_s": int(elapsed), "budget_s": int(total), "steps": steps, "failures": failures, "targets": targets}
with open(os.path.join(out, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
lines = [f"GPU check: {'OK' if ok else 'FAILED'}   CUDA: {gpu if cuda else 'no CUDA'}   "
         f"({elapsed} s of a {total} s budget)"]
lines += [f"{'step':<16}{'status':<17}{'time':>6}{'limit':>7}  {'file':<21}note"]
for s in steps:
    lines.append(f"{s['step']:<16}{s['status']:<17}{s['seconds']:>5}s{s['limit_s']:>6}s  {s['file'] or '-':<21}{s['note']}")
for name, t in targets.items():
    lines.append(f"target  {name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))
lines += [f"FAILED: {f}" for f in failures]
with open(os.path.join(out, "summary.txt"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
PY
rc=$?
if [ ! -s "$OUT/summary.txt" ]; then
  echo "GPU check: FAILED: the summary could not be written (exit status $rc); see logs.txt" | tee "$OUT/summary.txt"
  rc=1
fi
rm -rf "$WORK"
exit $rc
