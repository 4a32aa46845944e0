"""The ``rlink`` command: ``info``, ``doctor``, ``stats``, ``smoke``, ``learner``, ``token``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ._version import __version__
from .errors import ConfigError
from .transport import TRANSPORT_HELP, TRANSPORTS


def _info(args: argparse.Namespace) -> int:
    from .transport import UCX_INSTALL, choose, ucx_available
    from .transport.shm import channel as shm
    from .transport.ucx import probe as ucx_probe

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
        for name, devices in sorted(transports.items()):
            print(f"  {name:<10} {', '.join(devices)}")
    else:
        print(f"UCX: ucxx not installed, so the tcp and shm data planes are used; for the ucx plane: {UCX_INSTALL}")
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


def _doctor(args: argparse.Namespace) -> int:
    """Check this machine (and a running learner with --learner); exit 1 when a check fails."""
    from .actor import Actor
    from .config import Config
    from .doctor import checks as doctor
    from .doctor import remote as doctor_learner

    with _token_file_env(args.token_file):
        checks = doctor.system_checks(Config.from_env(), actors=args.actors)
        if args.learner:
            checks.append(doctor_learner.check_learner(args.learner, connect=Actor, attempts=args.attempts,
                                                       timeout=args.timeout))  # fmt: skip
            if checks[-1].status != "fail":
                checks.append(doctor_learner.check_job(args.learner, _stats_asker(args.learner, None, args.timeout)))
    doctor_learner.render(checks, as_json=args.json)
    return 1 if doctor.worst(checks) == "fail" else 0


@contextlib.contextmanager
def _token_file_env(path: str | None) -> Iterator[None]:
    """Meanwhile the token comes from ``path`` as if ``RLINK_TOKEN_FILE=path`` were set alone
    (everything that reads a token, the doctor's token row included, then sees that file)."""
    if path is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("RLINK_TOKEN", "RLINK_TOKEN_FILE")}
    os.environ.pop("RLINK_TOKEN", None)
    os.environ["RLINK_TOKEN_FILE"] = path
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stats_asker(address: str, token_file: str | None, timeout: float) -> Any:
    """``fetch`` with the token: from ``token_file``, else RLINK_TOKEN / RLINK_TOKEN_FILE, else
    the one a loopback learner generated for its port (rank 0's, for every rank of a job)."""
    from .doctor import stats as remote_stats
    from .session.tokens import read_token_file, resolve_token

    token = read_token_file(token_file) if token_file else resolve_token(None)
    token = token if token is not None else remote_stats.local_token(address)
    return functools.partial(remote_stats.fetch, token=token, timeout=timeout)


def _stats(args: argparse.Namespace) -> int:
    """Print a running learner job's stats: every rank, its actors, rates, staleness, weights lag."""
    from .doctor import stats as remote_stats
    from .errors import RLinkError

    ask = _stats_asker(args.address, args.token_file, args.timeout)
    interval = args.watch if args.watch else args.interval
    try:
        remote_stats.watch(args.address, ask, interval=interval, out=sys.stdout, as_json=args.json,
                           rounds=None if args.watch else 1)  # fmt: skip
    except RLinkError as exc:
        if isinstance(exc, ConfigError):
            raise
        print(f"rlink stats: {exc}", file=sys.stderr)
        return 1
    return 0


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
    from .session.tokens import read_token_file

    token = read_token_file(args.token_file) if args.token_file else None
    with _sigterm_exits(), Learner(args.address, token=token, transport=args.transport,
                                   metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                                   insecure=args.insecure) as learner:  # fmt: skip
        print(f"listening on {learner.address}", flush=True)
        if learner.token_file is not None:
            print(f"token for this user's local actors: {learner.token_file}", flush=True)
        if learner.metrics_address is not None:
            print(f"metrics on http://{learner.metrics_address}/metrics", flush=True)
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


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Meanwhile SIGTERM (``kill``, ``docker stop``, systemd) ends the command as Ctrl-C does,
    with exit status 143: ``with`` blocks close, so a learner tells its actors and removes the
    token file it generated. A second SIGTERM does not interrupt that."""
    if threading.current_thread() is not threading.main_thread():  # cli.main() called from a thread
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, where there is one to show (not None or off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _token(args: argparse.Namespace) -> int:
    """Print a new random token, or write it to a new 0600 file."""
    from .session.tokens import new_token, write_new

    token = new_token()
    if not args.file:
        print(token)
        return 0
    write_new(args.file, token)
    print(f"wrote a new token to {args.file} (mode 0600): use it with RLINK_TOKEN_FILE={args.file} "
          f"or rlink learner --token-file {args.file}", file=sys.stderr)  # fmt: skip
    return 0


_TOKEN_FILE_HELP = ("read the learner's token from this file (mode 0600), as RLINK_TOKEN_FILE (it wins over "
                    "RLINK_TOKEN); without either, a loopback learner's generated token is found by its port")  # fmt: skip

_NO_ARGV_TOKEN = ("--token is not accepted: a token on the command line is visible to every user in ps. "
                  "Set RLINK_TOKEN, or use --token-file PATH (make one with `rlink token --file PATH`)")  # fmt: skip


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    from .bench.suite import main as bench_main

    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink`` command's parser (``bench`` and ``demo`` parse their own options; docs/cli.md
    is generated from all of them by ci/cli_reference.py)."""
    parser = argparse.ArgumentParser(prog="rlink", description="rlink_ucx: actors -> learner over UCX or TCP")
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (connections, data planes)")
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=_HelpWithDefaults)  # --help shows the defaults
    p = add("info", help="library, UCX and CUDA versions; which data plane auto picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = add("doctor", help="check UCX, RDMA, CUDA, /dev/shm, limits and tokens (and a learner); advise")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--learner", default=None, metavar="HOST[:PORT]",
                   help="also connect to this learner as an actor would: reachability, auth, data plane, connect "
                        "time, and its job's ranks and placement (no port: 8443)")  # fmt: skip
    p.add_argument("--actors", type=int, default=16, help="actors you expect (sizes the /dev/shm and file checks)")
    p.add_argument("--attempts", type=int, default=3, help="connections to the learner to time")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each connection to the learner may take")
    p.add_argument("--token-file", default=None, metavar="PATH", help=_TOKEN_FILE_HELP)
    p = add("stats", help="a running learner's stats(): every rank of its job, actors, rates, staleness, weights lag")
    p.add_argument("address", metavar="HOST[:PORT]", help="the learner (rank 0 of a job of many; no port: 8443)")
    p.add_argument("--token-file", default=None, metavar="PATH", help=_TOKEN_FILE_HELP)
    p.add_argument("--json", action="store_true", help="print JSON (the table's rows and every rank's full stats())")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between the two readings that give the rates")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="print again every SECONDS (rates over each period) until Ctrl-C")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each connection to a learner may take")
    p = add("smoke", help="stream steps from actor processes to a learner and verify them")
    p.add_argument("--actors", type=int, default=2, help="actor processes")
    p.add_argument("--steps", type=int, default=50_000, help="steps per actor")
    p.add_argument("--transport", default="auto", choices=list(TRANSPORTS), help=TRANSPORT_HELP)
    p = add("learner", help="run a standalone learner that drains and logs")
    p.add_argument("--address", default="127.0.0.1:8443",
                   help="host[:port] to listen on (no port: 8443; port 0: any free port; a non-loopback host needs "
                        "a token)")  # fmt: skip
    p.add_argument("--token", default=None, metavar="-",
                   help="not accepted (argv shows in ps): set RLINK_TOKEN or use --token-file")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="read the token from this file (mode 0600; like RLINK_TOKEN_FILE). Without a token the "
                        "learner generates one for this user's local actors")  # fmt: skip
    p.add_argument("--insecure", action="store_true",
                   help="no authentication: any local process may connect (loopback addresses only)")
    p.add_argument("--transport", default="auto", choices=list(TRANSPORTS), help=TRANSPORT_HELP)
    p.add_argument("--batch-size", type=int, default=256, help="steps per batch the learner drains")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0: run until Ctrl-C or SIGTERM)")
    p.add_argument("--log-every", type=float, default=5.0, help="seconds between stats lines")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0: any free port; off when not given)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics endpoint (it has no authentication: keep it on loopback)")
    p = add("token", help="print a new random token (or write it to a new 0600 file)")
    p.add_argument("--file", default=None, metavar="PATH", help="write it to this new file (mode 0600) instead")
    sub.add_parser("bench", help="rlink vs the physical limits and its peers (see `rlink bench --help`)", add_help=False)
    sub.add_parser("demo", help="train PPO on CartPole with actor processes (see `rlink demo --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "learner" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "token", None) is not None:
        parser.error(_NO_ARGV_TOKEN)  # never echoes the value
    handlers: dict[str, Any] = {"info": _info, "doctor": _doctor, "stats": _stats, "smoke": _smoke,
                                "learner": _learner, "token": _token}  # fmt: skip
    try:
        if args.command == "bench":
            return _bench(args, [r for r in rest if r != "--"])
        return int(handlers[args.command](args))
    except ConfigError as exc:
        print(f"rlink {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
