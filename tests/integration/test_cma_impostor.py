"""Direct reads (process_vm_readv) only ever read the actor's own process.

An authenticated actor names its pid in Hello, and the probe's address and nonce in Attach:
all its own choice. Here it names someone else (the learner itself, or a bystander holding a
secret at a known address) and sends a frame "by address" pointing at that secret. The
learner must check the pid with the kernel, refuse direct reads (with a log line) and never
deliver the bystander's bytes as a step.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from rlink_ucx import Learner, RLinkDataset
from rlink_ucx.errors import TimeoutError as RLinkTimeout
from rlink_ucx.transport.shm import cma
from tests.conftest import shm_possible
from tests.integration.hostile import cma_impostor_proc, honest_direct_proc, secret_memory, victim_proc

SPAWN = mp.get_context("spawn")
TOKEN = b"cma-impostor-test-token-0123456789"
NBYTES = cma.MIN_BYTES  # a frame this large goes by address

pytestmark = [pytest.mark.skipif(not shm_possible() or not cma.available(), reason="no memfd or process_vm_readv"),
              pytest.mark.timeout(120)]  # fmt: skip


def _run(learner: Learner, target, *args) -> tuple[str, object]:
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=target, args=(learner.address, TOKEN, *args, out))
    proc.start()
    try:
        return out.get(timeout=60)
    finally:
        proc.join(30)


@pytest.mark.parametrize("victim", ["learner", "bystander"])
def test_an_actor_naming_another_process_gets_no_direct_reads_and_its_secret_is_never_delivered(victim, caplog):
    caplog.set_level(logging.INFO, logger="rlink_ucx")
    stop = SPAWN.Event()
    bystander = None
    with Learner("127.0.0.1:0", token=TOKEN, transport="shm") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        if victim == "learner":  # the learner's own memory: it may always read itself
            secret = secret_memory(NBYTES, seed=5)
            pid, where = os.getpid(), secret.ctypes.data
        else:  # a third process of the same user
            found = SPAWN.Queue()
            bystander = SPAWN.Process(target=victim_proc, args=(NBYTES, 5, found, stop))
            bystander.start()
            pid, where = found.get(timeout=60)
            secret = secret_memory(NBYTES, seed=5)  # the same bytes, to recognise them
        nonce = ctypes.string_at(where, 16) if victim == "learner" else secret[:16].tobytes()
        try:
            kind, offered = _run(learner, cma_impostor_proc, pid, where, NBYTES, nonce)
            assert kind == "ready", offered
            assert offered is False, "the learner offered to read a process the actor only named"
            # Its refused frame ends the impostor's session; once ended, nothing it sent can still
            # arrive, so a short fetch then shows what was delivered (a fetch of 4 s waited blind).
            deadline = time.monotonic() + 30
            while not learner.stats()["ended_actors"]:
                assert time.monotonic() < deadline, "the impostor's session did not end"
                time.sleep(0.05)
            with pytest.raises(RLinkTimeout):  # nothing is delivered, least of all the secret
                got = dataset.fetch(timeout=1)
                assert not np.array_equal(np.asarray(got["x"][0]), secret), "the learner delivered the secret"
            ended = learner.stats()["ended_actors"]
            assert ended and ended[0]["protocol_errors"] == 1, ended  # its frame by address was refused
        finally:
            if bystander is not None:
                # Killed, not woken: a multiprocessing Event's set() waits for every sleeper
                # to acknowledge, and hung for the whole test timeout once in a full run.
                bystander.kill()
                bystander.join(30)
    refusals = [r.getMessage() for r in caplog.records if "does not hold the actor's end" in r.getMessage()]
    assert refusals and f"process {pid} " in refusals[0], [r.getMessage() for r in caplog.records]


def test_an_actor_naming_its_own_process_still_gets_direct_reads(caplog):
    caplog.set_level(logging.INFO, logger="rlink_ucx")
    with Learner("127.0.0.1:0", token=TOKEN, transport="shm") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        kind, offered = _run(learner, honest_direct_proc, NBYTES, 9)
        assert (kind, offered) == ("ready", True)
        got = dataset.fetch(timeout=30)
        assert np.array_equal(np.asarray(got["x"][0]), secret_memory(NBYTES, seed=9))
    assert not [r for r in caplog.records if "does not hold the actor's end" in r.getMessage()]
