"""Publishing CUDA parameters: copied to host memory once per version, tagged there, and that
copy sent on each actor's weights stream; no torch.distributed group (protocol 8).
Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``."""

from __future__ import annotations

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from rlink_ucx import Learner  # noqa: E402
from tests.integration.procs import as_bytes  # noqa: E402


def _cuda_subscriber(address: str, device: int, results, leave) -> None:
    import faulthandler
    import traceback

    import torch

    from rlink_ucx import Actor

    faulthandler.dump_traceback_later(60)  # a hang shows where, in the test's captured output
    try:
        torch.cuda.set_device(device)
        with Actor(address, transport="tcp", subscribe=True) as actor:
            results.put({"first": actor.get_remote_model(timeout=50)[1]})
            while actor.get_remote_model(timeout=50, latest=False)[1] < 3:
                pass
            state, version = actor.get_remote_model(timeout=30)
            results.put({"version": version, "state": as_bytes(state), "devices": sorted({str(t.device) for t in state.values()}),
                         "stats": actor.stats()["weights"]})  # fmt: skip
            leave.wait(60)
    except BaseException:  # noqa: BLE001 - the test reports it
        results.put({"error": traceback.format_exc()})


def cuda_state(version: int) -> dict:
    g = torch.Generator(device="cuda:0").manual_seed(version)
    return {"w": torch.randn(1 << 20, device="cuda:0", generator=g), "b": torch.full((7,), float(version), device="cuda:0")}


@pytest.mark.gpu
@pytest.mark.timeout(150)
def test_cuda_parameters_reach_actors_bit_identical():
    devices = [1] if torch.cuda.device_count() > 1 else [0]
    ctx = mp.get_context("spawn")
    results, leave = ctx.Queue(), ctx.Event()
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        procs = [ctx.Process(target=_cuda_subscriber, args=(learner.address, d, results, leave)) for d in devices]
        for p in procs:
            p.start()
        assert learner.publish(cuda_state(1), wait=True, timeout=60) == 1
        snap = learner._server.publisher.latest
        assert snap.device == "cuda:0" and snap.host is not None and snap.host.tags == snap.tags
        snap.verify()  # the device buffer, read back, matches the tags of its host copy
        firsts = [results.get(timeout=75) for _ in procs]
        assert [r.get("first") for r in firsts] == [1] * len(procs), firsts
        for v in (2, 3):  # on the weights stream each actor holds now
            assert learner.publish(cuda_state(v), wait=True, timeout=60) == v
        reports = [results.get(timeout=75) for _ in procs]
        assert not [r["error"] for r in reports if "error" in r]
        leave.set()
        for p in procs:
            p.join(60)
        stats = learner.stats()["weights"]
    expected = as_bytes(cuda_state(3))
    for r in reports:
        assert r["version"] == 3 and r["state"] == expected
        assert r["devices"] == ["cpu"], r["devices"]  # versions land in host memory
        assert r["stats"]["failures"] == 0 and r["stats"]["streamed"] == 3 and r["stats"]["rejected"] == 0, r["stats"]
    assert stats["fanout_failures"] == 0 and stats["streamed"] == 3 * len(procs), stats
