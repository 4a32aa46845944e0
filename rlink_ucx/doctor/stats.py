"""``rlink stats ADDR``: a running learner's ``stats()`` over the network, for every rank of its job.

One short authenticated connection per learner: the client proves the token as an actor does
(``Login``, and checks the learner's ``Proof``), sends ``StatsRequest`` and reads one
``StatsReply``, which holds exactly what ``Learner.stats()`` returns there. Rank 0 of a job
lists every rank's address (``stats()["ranks"]``); the other ranks are asked there. Rates come
from two such rounds ``interval`` seconds apart: the learner keeps only counters.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from ..config import Config
from ..errors import AuthError, ConnectError, ProtocolError, RLinkError
from ..session import tokens
from ..transport.address import format_address, is_loopback, parse_endpoint
from ..wire import auth as _auth
from ..wire import messages as _wire

MAX_REPLY_BYTES = 64 << 20  # a learner's stats list its last 1000 ended actors: far below this


def fetch(address: str, *, token: bytes | None, timeout: float = 10.0, config: Config | None = None) -> dict[str, Any]:
    """``Learner.stats()`` of the learner at ``address`` (``host[:port]``, port 8443 when left out).

    ``token``: the learner's token (None for a learner that does not authenticate; see
    :func:`local_token`). Each socket operation is bounded by ``timeout`` seconds.

    Raises:
        ConfigError: a malformed address.
        AuthError: the learner refused the token, or needs one and none was found.
        ConnectError: no learner answered there in time.
        ProtocolError: something that is not an rlink learner of this version answered.
    """
    host, port, _ = parse_endpoint(address)
    where = format_address(host, port)
    config = config or Config.from_env()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return _ask(sock, host, port, token, config)
    except RLinkError:  # some derive from OSError too: they say more than "no answer"
        raise
    except (TimeoutError, OSError) as exc:
        raise ConnectError(f"no answer from a learner at {where} within {timeout:g}s: {exc}") from exc


def _ask(sock: socket.socket, host: str, port: int, token: bytes | None, config: Config) -> dict[str, Any]:
    where = format_address(host, port)
    challenge = _wire.read_message(sock, config.max_preauth_bytes)
    if not isinstance(challenge, _wire.Challenge):
        raise ProtocolError(f"{where} is not an rlink learner (it sent {type(challenge).__name__} first)")
    if challenge.proto != _wire.PROTOCOL_VERSION:
        raise ProtocolError(f"the learner at {where} speaks protocol {challenge.proto}, this rlink "
                            f"{_wire.PROTOCOL_VERSION}: use the same rlink_ucx version on both sides")  # fmt: skip
    if challenge.auth and token is None:
        raise AuthError(f"the learner at {where} requires a token and none was found: use --token-file PATH or "
                        "set RLINK_TOKEN / RLINK_TOKEN_FILE (a loopback learner's generated token is found by its port)")  # fmt: skip
    nonce = _auth.new_nonce()
    mac = _auth.actor_proof(token, challenge.nonce, nonce) if challenge.auth and token is not None else b""
    sock.sendall(_wire.encode(_wire.Login(_wire.PROTOCOL_VERSION, nonce, mac)))
    if challenge.auth and token is not None:
        proof = _reply(sock, where, _wire.Proof)
        _auth.verify(_auth.learner_proof(token, challenge.nonce, nonce), proof.mac, "learner")
    sock.sendall(_wire.encode(_wire.StatsRequest()))
    return dict(_reply(sock, where, _wire.StatsReply).stats)


def local_token(address: str, config: Config | None = None) -> bytes | None:
    """The token a learner of this user generated for the port of ``address``, where that is a
    loopback address (as a local actor finds it); else None. Every rank of a job takes rank 0's."""
    host, port, _ = parse_endpoint(address)
    if not is_loopback(host):
        return None
    return tokens.find(config or Config.from_env(), port)[0]


def _reply(sock: socket.socket, where: str, kind: type[Any]) -> Any:
    msg = _wire.read_message(sock, MAX_REPLY_BYTES)
    if isinstance(msg, _wire.Error) and msg.kind == "auth":
        raise AuthError(f"the learner at {where} refused the token ({msg.text}): give the learner's token with "
                        "--token-file PATH or RLINK_TOKEN / RLINK_TOKEN_FILE")  # fmt: skip
    if isinstance(msg, _wire.Error):
        raise ProtocolError(f"the learner at {where} refused: {msg.text}")
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__} from {where}, got {type(msg).__name__}")
    return msg


def job(address: str, ask: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The stats of every rank of the job whose rank 0 (or lone learner) is at ``address``,
    by rank: rank 0's own, then each rank's at the address rank 0 lists for it. A rank that
    cannot be asked is a row ``{"rank": r, "address": ..., "error": "..."}``."""
    first = ask(address)
    rows = [first]
    for rank, where in sorted((int(r), str(d["address"])) for r, d in (first.get("ranks") or {}).items()):
        if rank == first.get("rank", 0):
            continue
        try:
            rows.append(ask(where))
        except (ConnectError, AuthError, ProtocolError) as exc:
            rows.append({"rank": rank, "address": where, "error": str(exc)})
    return rows


@dataclass(frozen=True)
class RankView:
    """One rank's row of ``rlink stats``: placement, rates over the interval, staleness, weights."""

    rank: int
    address: str
    actors: int
    steps_per_s: float
    mb_per_s: float
    steps: int
    staleness_mean: float
    staleness_max: int
    weights_version: int
    weights_lag_max: int
    buffered_bytes: int
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def view(before: list[dict[str, Any]], after: list[dict[str, Any]], seconds: float) -> list[RankView]:
    """Each rank of ``after`` with its rates since ``before`` (the same job ``seconds`` earlier)."""
    earlier = {row.get("rank", 0): row for row in before}
    return [_rank_view(row, earlier.get(row.get("rank", 0)), seconds) for row in after]


def _rank_view(now: dict[str, Any], then: dict[str, Any] | None, seconds: float) -> RankView:
    if "error" in now or "total" not in now:
        return RankView(int(now.get("rank", 0)), str(now.get("address", "?")), 0, 0.0, 0.0, 0, 0.0, 0, 0, 0, 0,
                        str(now.get("error", "closed")))  # fmt: skip
    steps, nbytes = now["total"]["steps"], now["total"]["bytes"]
    d_steps = steps - then["total"]["steps"] if then and "total" in then else 0
    d_bytes = nbytes - then["total"]["bytes"] if then and "total" in then else 0
    version = int(now["version"])
    lags = [version - a["weights_version"] for a in now["actors"] if a.get("subscribed") and a.get("weights_version", -1) >= 0]
    return RankView(
        rank=int(now.get("rank", 0)), address=str(now["address"]), actors=int(now["connected_actors"]),
        steps_per_s=d_steps / seconds if seconds > 0 else 0.0, mb_per_s=d_bytes / seconds / 1e6 if seconds > 0 else 0.0,
        steps=int(steps), staleness_mean=float(now["staleness"]["mean"]), staleness_max=int(now["staleness"]["max"]),
        weights_version=version, weights_lag_max=max(lags, default=0),
        buffered_bytes=int(now["buffer"]["buffered_bytes"]),
    )  # fmt: skip


def render(rows: list[RankView], seconds: float, out: TextIO, *, as_json: bool = False,
           raw: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
    """Print the table (or, with ``as_json``, the rows and every rank's full ``stats()``)."""
    if as_json:
        print(json.dumps({"interval_s": seconds, "ranks": [r.as_dict() for r in rows], "stats": raw or []},
                         default=str), file=out, flush=True)  # fmt: skip
        return
    world = len(rows)
    print(f"learner job of {world} rank{'s' if world != 1 else ''}; rates over {seconds:.1f}s", file=out)
    head = f"{'rank':>4}  {'address':<22}{'actors':>7}{'steps/s':>11}{'MB/s':>9}{'steps':>12}"
    print(head + f"{'stale mean':>11}{'max':>5}{'weights v':>10}{'lag max':>8}{'buffered MB':>12}", file=out)
    for r in rows:
        if r.error:
            print(f"{r.rank:>4}  {r.address:<22}  unreachable: {r.error}", file=out)
            continue
        print(f"{r.rank:>4}  {r.address:<22}{r.actors:>7}{r.steps_per_s:>11,.0f}{r.mb_per_s:>9.2f}{r.steps:>12,}"
              f"{r.staleness_mean:>11.2f}{r.staleness_max:>5}{r.weights_version:>10}{r.weights_lag_max:>8}"
              f"{r.buffered_bytes / 1e6:>12.1f}", file=out)  # fmt: skip
    total = sum(r.steps_per_s for r in rows)
    print(f"total: {sum(r.actors for r in rows)} actors, {total:,.0f} steps/s", file=out, flush=True)


def watch(address: str, ask: Callable[[str], dict[str, Any]], *, interval: float, out: TextIO, as_json: bool,
          rounds: int | None = None) -> None:  # fmt: skip
    """Print the job's view every ``interval`` seconds (``rounds`` times; None: until Ctrl-C),
    each round's rates over the time since the one before."""
    before, t0 = job(address, ask), time.monotonic()
    done = 0
    while rounds is None or done < rounds:
        time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        after, t1 = job(address, ask), time.monotonic()
        render(view(before, after, t1 - t0), t1 - t0, out, as_json=as_json, raw=after)
        before, t0 = after, t1
        done += 1
