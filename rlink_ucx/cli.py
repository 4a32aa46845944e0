"""The ``rlink`` command: ``info``/``doctor``, ``smoke``, ``learner``, ``bench``."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import time
from typing import Any

from ._version import __version__
from .transport import TRANSPORT_HELP, TRANSPORTS


def _info(args: argparse.Namespace) -> int:
    from .transport import choose, shm, ucx_available, ucx_probe

    ucx = ucx_available()
    transports = ucx_probe.transports() if ucx else {}
    cuda = _cuda_state()
    picked, reason = choose("auto", "auto", learner_ucx=ucx, actor_ucx=ucx)
    local, local_reason = choose("auto", "auto", learner_ucx=ucx, actor_ucx=ucx, same_host=True, shm=shm.available())
    report = {
        "rlink_ucx": __version__,
        "python": sys.version.split()[0],
        "ucxx_installed": ucx,
        "ucx_version": ucx_probe.version() if ucx else None,
        "ucx_transports": {k: v for k, v in sorted(transports.items())},
        "cuda": cuda,
        "auto_data_plane": picked,
        "auto_reason": reason,
        "auto_same_host_data_plane": local,
        "auto_same_host_reason": local_reason,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"rlink_ucx {__version__} (python {report['python']})")
    if ucx:
        print(f"UCX {report['ucx_version'] or '?'} via ucxx; transports:")
        for name, devices in report["ucx_transports"].items():
            print(f"  {name:<10} {', '.join(devices)}")
    else:
        print("UCX: ucxx not installed (pip install 'rlink-ucx[cu12]'); the tcp data plane is used")
    print(f"CUDA: {cuda}")
    print(f"transport='auto' picks, for an actor on another host: {picked} ({reason})")
    print(f"                         for an actor on this host: {local} ({local_reason})")
    return 0


def _cuda_state() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} device(s): {', '.join(names)}"


def _smoke_actor(address: str, transport: str, actor: int, steps: int, token: str | None) -> None:
    import numpy as np

    from .actor import Actor

    with Actor(address, transport=transport, actor_id=actor, token=token) as a:
        chunk = 64
        for start in range(0, steps, chunk):
            k = min(chunk, steps - start)
            seq = np.arange(start, start + k)
            a.put_many({
                "obs": np.repeat(seq[:, None].astype(np.float32), 4, axis=1),
                "action": seq.astype(np.int64),
                "reward": np.ones(k, np.float32),
                "done": seq % 200 == 199,
            })  # fmt: skip
        a.flush(60)


def _smoke(args: argparse.Namespace) -> int:
    """Start a learner and actor processes on loopback, stream, verify every step, report."""
    from .dataset import RLinkDataset
    from .learner import Learner

    total = args.actors * args.steps
    batch_size = max(d for d in range(1, min(1024, total) + 1) if total % d == 0)  # fetch every step
    with Learner("127.0.0.1:0", transport=args.transport) as learner:
        dataset = RLinkDataset(learner, batch_size=batch_size)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_smoke_actor, args=(learner.address, args.transport, i + 1, args.steps, None))
                 for i in range(args.actors)]  # fmt: skip
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        seen: dict[int, list[int]] = {}
        received = 0
        while received + batch_size <= total:
            batch = dataset.fetch(timeout=60)
            for actor, seq, action in zip(batch.actor_id.tolist(), batch.seq.tolist(), batch["action"].tolist()):
                if action != seq:
                    raise SystemExit(f"corrupt step from actor {actor}: action {action} != seq {seq}")
                seen.setdefault(actor, []).append(seq)
            received += batch_size
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(60)
        stats = learner.stats()
    ordered = all(v == list(range(args.steps)) for v in seen.values())
    transports = sorted({a["transport"] for a in stats["ended_actors"] + stats["actors"]})
    print(f"learner received {received} steps from {len(seen)} actors in {elapsed:.2f}s "
          f"({received / elapsed:,.0f} steps/s) over {', '.join(transports)}; "
          f"in order and exactly once: {ordered}")  # fmt: skip
    return 0 if ordered and len(seen) == args.actors else 1


def _learner(args: argparse.Namespace) -> int:
    """A standalone learner that drains steps and logs stats (for smoke tests across hosts)."""
    from .dataset import RLinkDataset
    from .errors import TimeoutError as RLinkTimeout
    from .learner import Learner

    with Learner(args.address, token=args.token, transport=args.transport) as learner:
        print(f"listening on {learner.address}", flush=True)
        dataset = RLinkDataset(learner, batch_size=args.batch_size)
        deadline = time.monotonic() + args.seconds if args.seconds else None
        last = time.monotonic()
        while deadline is None or time.monotonic() < deadline:
            try:
                dataset.fetch(timeout=1.0)
            except RLinkTimeout:
                pass
            if time.monotonic() - last >= args.log_every:
                last = time.monotonic()
                s = learner.stats()
                logging.getLogger("rlink").info("actors=%d steps=%d bytes=%d buffered=%d", s["connected_actors"],
                                                s["total"]["steps"], s["total"]["bytes"], s["buffer"]["buffered_bytes"])
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    from .bench.suite import main as bench_main

    return bench_main(rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlink", description="rlink_ucx: actors -> learner over UCX or TCP")
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (connections, data planes)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", aliases=["doctor"], help="library, UCX and CUDA versions; which data plane auto picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = sub.add_parser("smoke", help="stream steps from actor processes to a learner and verify them")
    p.add_argument("--actors", type=int, default=2, help="actor processes")
    p.add_argument("--steps", type=int, default=50_000, help="steps per actor")
    p.add_argument("--transport", default="auto", choices=list(TRANSPORTS), help=TRANSPORT_HELP)
    p = sub.add_parser("learner", help="run a standalone learner that drains and logs")
    p.add_argument("--address", default="127.0.0.1:8443",
                   help="host:port to listen on (port 0: any free port; a non-loopback host needs a token)")
    p.add_argument("--token", default=None, help="shared secret; prefer RLINK_TOKEN or RLINK_TOKEN_FILE (argv shows in ps)")
    p.add_argument("--transport", default="auto", choices=list(TRANSPORTS), help=TRANSPORT_HELP)
    p.add_argument("--batch-size", type=int, default=256, help="steps per batch the learner drains")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0 = run until Ctrl-C)")
    p.add_argument("--log-every", type=float, default=5.0, help="seconds between stats lines")
    sub.add_parser("bench", help="rlink vs the physical limits and its peers (see `rlink bench --help`)", add_help=False)
    sub.add_parser("demo", help="train PPO on CartPole with actor processes (see `rlink demo --help`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "learner" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers: dict[str, Any] = {"info": _info, "doctor": _info, "smoke": _smoke, "learner": _learner}
    try:
        if args.command == "bench":
            return _bench(args, [r for r in rest if r != "--"])
        return int(handlers[args.command](args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
