"""``rlink doctor --learner``: reach a running learner as an actor would, and the report itself.

The learner check does real handshakes (TCP connect, mutual token proof, Hello/Welcome, data
plane attach) and leaves without sending a step, so it costs a running learner nothing but a
few short sessions. The connection is made by the ``connect`` callable the caller passes (the
public ``Actor``), so the doctor sees exactly what an actor of this host would: the token it
finds, the data plane the learner picks for it, the time a connection takes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TextIO

from .._version import __version__
from ..config import Config
from ..errors import AuthError, ConfigError, ConnectError, RLinkError
from ..session.actor.connect import Rejected
from ..transport.address import format_address, parse_endpoint
from .checks import Check, worst
from .stats import job


class Connected(Protocol):
    """What the doctor reads off a connected actor (read-only, as ``Actor`` exposes them)."""

    @property
    def transport(self) -> str: ...
    @property
    def transport_reason(self) -> str: ...
    @property
    def actor_id(self) -> int: ...
    @property
    def policy_version(self) -> int: ...


class Connect(Protocol):
    def __call__(self, address: str, *, config: Config) -> AbstractContextManager[Connected]: ...


def check_learner(address: str, *, connect: Connect, attempts: int = 3, timeout: float = 10.0) -> Check:
    """Connect to the learner at ``address`` ``attempts`` times (each within ``timeout``) and
    report reachability, authentication, the data plane it picks and the connect time."""
    try:
        host, port, _ = parse_endpoint(address)
    except ConfigError as exc:
        return Check("learner", "fail", str(exc), "give the learner as host:port", {"address": address,
                     "reachable": False, "auth": "not tried"})  # fmt: skip
    where = format_address(host, port)
    data: dict[str, Any] = {"address": where, "reachable": False, "auth": "not tried"}
    config = Config.from_env(connect_timeout=timeout, handshake_timeout=min(5.0, timeout), reconnect_timeout=0)
    times: list[float] = []
    try:
        for _ in range(attempts):
            t0 = time.perf_counter()
            with connect(address, config=config) as actor:
                times.append((time.perf_counter() - t0) * 1e3)
                data.update(transport=actor.transport, transport_reason=actor.transport_reason,
                            model_version=actor.policy_version)  # fmt: skip
    except AuthError as exc:
        data.update(reachable=True, auth="failed", error=str(exc))
        return Check("learner", "fail", f"{where} answered but authentication failed: {exc}",
                     "give this host the learner's token (RLINK_TOKEN or RLINK_TOKEN_FILE with the same secret on "
                     "both sides; a learner started without one keeps its own in its user's token directory)", data)  # fmt: skip
    except Rejected as exc:
        data.update(reachable=True, auth="ok", error=str(exc))
        return Check("learner", "fail", f"{where} refused the session: {exc}",
                     "use the same rlink_ucx version on both sides and a transport both can use", data)  # fmt: skip
    except ConfigError as exc:
        data.update(error=str(exc))
        return Check("learner", "fail", str(exc), "fix the token variable or file first (see the token row)", data)
    except (ConnectError, RLinkError) as exc:
        data.update(error=str(exc))
        return Check("learner", "fail", f"cannot reach {where} within {timeout:g}s: {exc}",
                     "is a learner running there? It listens on 127.0.0.1 unless given another address "
                     "(0.0.0.0 needs a token); check firewalls and that the port is published", data)  # fmt: skip
    rtt = statistics.median(times)
    data.update(reachable=True, auth="ok", connect_ms=[round(t, 3) for t in times], rtt_ms=round(rtt, 3))
    summary = (f"{where}: token accepted; data plane {data['transport']} ({data['transport_reason']}); "
               f"connect {rtt:.1f} ms (median of {len(times)}: TCP, mutual auth, session, plane attach)")
    advice = "" if rtt < 250 else "a slow connect: a distant or overloaded learner (see its stats and logs)"
    return Check("learner", "ok" if rtt < 250 else "warn", summary, advice, data)


def check_job(address: str, ask: Callable[[str], dict[str, Any]]) -> Check:
    """The learner's job as its ``stats()`` tell: how many ranks, where each listens, how many
    actors each serves now (``rlink stats`` adds rates, staleness and weights lag)."""
    try:
        rows = job(address, ask)
    except RLinkError as exc:
        return Check("learner_job", "warn", f"could not read the learner's stats: {exc}",
                     "the stats request needs the same token as an actor (--token-file PATH)", {"error": str(exc)})  # fmt: skip
    first = rows[0]
    world = int(first.get("world_size", 1))
    placed = [{"rank": int(r.get("rank", 0)), "address": r.get("address"), "actors": r.get("connected_actors"),
               "error": r.get("error")} for r in rows]  # fmt: skip
    data = {"world_size": world, "ranks": placed}
    if world == 1:
        return Check("learner_job", "ok", f"a lone learner (rank 0 of 1) serving {first['connected_actors']} actors", "", data)
    where = "; ".join(f"rank {p['rank']} at {p['address']}: " + (f"{p['actors']} actors" if not p["error"] else
                      f"unreachable ({p['error']})") for p in placed)  # fmt: skip
    summary = f"a job of {world} learner ranks; rank 0 places each actor on one: {where}"
    missing = world - len(placed)
    if missing or any(p["error"] for p in placed):
        return Check("learner_job", "warn", summary + (f"; {missing} rank(s) not linked to rank 0" if missing else ""),
                     "a rank that has not linked to rank 0 gets no actors: see that rank's log", data)  # fmt: skip
    return Check("learner_job", "ok", summary, "", data)


def report(checks: list[Check]) -> dict[str, Any]:
    """The JSON form: versions, the worst status, and ``checks`` by name."""
    return {"rlink_ucx": __version__, "python": sys.version.split()[0], "status": worst(checks),
            "checks": {c.name: c.as_dict() for c in checks}}  # fmt: skip


def render(checks: list[Check], out: TextIO | None = None, *, as_json: bool = False) -> None:
    """Print the report: JSON, a ``rich`` table where rich is installed, else plain text."""
    out = out or sys.stdout
    if as_json:
        print(json.dumps(report(checks), indent=2), file=out)
        return
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        _plain(checks, out)
        return
    colour = {"ok": "green", "skip": "dim", "warn": "yellow", "fail": "bold red"}
    table = Table(title=f"rlink doctor (rlink_ucx {__version__})", show_lines=False)
    for column in ("check", "status", "finding", "advice"):
        table.add_column(column, overflow="fold")
    for c in checks:
        # Findings and advice are plain text: "rlink-ucx[cu12]" is not markup.
        table.add_row(escape(c.name), f"[{colour[c.status]}]{c.status}[/]", escape(c.summary), escape(c.advice))
    console = Console(file=out, width=max(120, Console(file=out).width))
    console.print(table)
    console.print(f"overall: {worst(checks)}")


def _plain(checks: list[Check], out: TextIO) -> None:
    width = max(len(c.name) for c in checks)
    print(f"rlink doctor (rlink_ucx {__version__})", file=out)
    for c in checks:
        print(f"{c.name:<{width}}  {c.status:<4}  {c.summary}", file=out)
        if c.advice:
            print(f"{'':<{width}}        -> {c.advice}", file=out)
    print(f"overall: {worst(checks)}", file=out)
