"""Fuzz what the learner reads from the network, for as long as asked.

    python bench/fuzz.py [--seconds 60] [--seed N] [--stages decode,preauth,...] [--atheris]

Every control message type (with hostile field values, mutated, or as noise) at every stage
of a connection: ``decode`` (the codec alone), ``preauth`` (the first bytes of a connection),
``authenticated`` (after a valid login, where Hello belongs), ``session`` (an open session's
control connection), ``attach`` (a data connection's Attach with a valid proof), ``header``
(a data frame's header) and ``records`` (the shm data connection). The same targets as
``tests/unit/test_fuzz.py`` (tests/fuzzing.py), on random inputs instead of hypothesis'.

Each input must end in a typed outcome, within a tracemalloc peak (``--peak-mib``, plus 64
bytes per input byte for decoding) and a time bound (``--input-seconds``). A finding is
printed and saved under ``--out``; the exit status is 1 if there was any. ``--atheris`` lets
atheris (libFuzzer, coverage-guided; ``pip install atheris``) choose the bytes instead.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.fuzzing

from tests import fuzzing as fz  # noqa: E402

STAGES = ("decode", "preauth", "authenticated", "session", "attach", "header", "records")


def make_input(stage: str, rng: random.Random) -> bytes:
    if stage == "decode":
        return fz.hostile_body(rng) if rng.random() < 0.8 else fz.mutate(rng, fz.hostile_body(rng))
    if stage == "preauth":
        return fz.hostile_stream(rng, fz.PREAUTH_TYPES)
    if stage == "authenticated":
        return fz.hostile_stream(rng, fz.HELLO_TYPES)
    if stage == "session":
        return fz.hostile_stream(rng, fz.SESSION_TYPES)
    if stage == "attach":
        return fz.hostile_body(rng, fz._wire.Attach)
    if stage == "header":
        return fz.hostile_header(rng)
    return fz.hostile_records(rng)


def decode(body: bytes) -> str:
    try:
        fz._wire.decode(body)
        return "accepted"
    except fz.ProtocolError:
        return "ProtocolError"


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lab = fz.Lab()
        self.targets = {"decode": decode, "preauth": self.lab.preauth, "authenticated": self.lab.authenticated,
                        "session": self.lab.session, "attach": self.lab.attach, "header": fz.Lab.header,
                        "records": fz.Lab.records}  # fmt: skip
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.worst: dict[str, tuple[int, float]] = collections.defaultdict(lambda: (0, 0.0))
        self.findings = 0

    def one(self, stage: str, data: bytes) -> None:
        peak = (self.args.peak_mib << 20) + 64 * len(data)
        result, error, top, took = fz.measure(self.targets[stage], data)
        worst = self.worst[stage]
        self.worst[stage] = (max(worst[0], top), max(worst[1], took))
        problem = None
        if top > peak:
            problem = f"allocated {top} bytes at peak (bound {peak})"
        elif took > self.args.input_seconds:
            problem = f"took {took:.2f}s (bound {self.args.input_seconds}s)"
        elif error is not None:
            try:
                result = fz.outcome(error)
            except fz.Finding as exc:
                problem = str(exc)
        if problem is None:
            self.outcomes[stage][result] += 1
            return
        self.findings += 1
        self.args.out.mkdir(parents=True, exist_ok=True)
        path = self.args.out / f"{stage}-{self.findings}.bin"
        path.write_bytes(data)
        print(f"FINDING [{stage}] {problem}; input ({len(data)} bytes) saved to {path}", flush=True)
        if self.args.atheris:
            raise fz.Finding(problem)

    def report(self, seconds: float) -> None:
        total = sum(sum(c.values()) for c in self.outcomes.values())
        print(f"{total} inputs in {seconds:.0f}s, {self.findings} findings")
        for stage in STAGES:
            if stage in self.outcomes:
                peak, took = self.worst[stage]
                counts = ", ".join(f"{k} {v}" for k, v in self.outcomes[stage].most_common())
                print(f"  {stage:14} worst peak {peak / 1024:8.1f} KiB, worst {took * 1000:7.1f} ms: {counts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--peak-mib", type=int, default=4, help="tracemalloc peak allowed per input")
    parser.add_argument("--input-seconds", type=float, default=2.0, help="time allowed per input")
    parser.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    parser.add_argument("--atheris", action="store_true", help="coverage-guided bytes from atheris")
    args = parser.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    if unknown := set(stages) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    logging.disable(logging.CRITICAL)  # refusals are logged by design: thousands of lines
    run = Run(args)
    started = time.monotonic()
    try:
        if args.atheris:
            fuzz_with_atheris(run, stages, args.seconds)
        else:
            seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
            print(f"seed {seed}", flush=True)
            rng = random.Random(seed)
            while time.monotonic() - started < args.seconds:
                for stage in stages:
                    run.one(stage, make_input(stage, rng))
    finally:
        run.report(time.monotonic() - started)
        run.lab.close()
    return 1 if run.findings else 0


def fuzz_with_atheris(run: Run, stages: list[str], seconds: float) -> None:
    import atheris

    def one_input(data: bytes) -> None:
        if data:
            run.one(stages[data[0] % len(stages)], data[1:])

    atheris.instrument_all()
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-timeout=10", "-rss_limit_mb=4096"], one_input)
    try:
        atheris.Fuzz()
    except SystemExit:  # libFuzzer exits when the time is up
        pass


if __name__ == "__main__":
    sys.exit(main())
