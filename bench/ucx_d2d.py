"""Raw ucxx, device to device: the ceiling rlink's CUDA path is compared with.

Two processes (spawn) on this host, each with a UCX worker made the way rlink's ``ucx`` plane
makes its own (``rlink_ucx.transport.ucx.learner.make_worker``: same UCX options, ucxx's low-level
API). The sender ``tag_send``s one preallocated CUDA buffer over and over, keeping ``--window``
sends in flight; the receiver keeps ``--window`` receives posted into CUDA buffers of its own
and reposts each one as it completes. GB/s is measured at the receiver, after skipping the
first 5% of the messages (as bench/throughput.py does), median of ``--reps`` runs per size.
Before each run the receiver clears its buffers and after it checks that the sender's fill
byte arrived (first and last byte of every slot), so a run that moved nothing cannot pass.

``--host-memory`` runs the same loop on numpy host buffers over UCX's TCP transport on
loopback (``UCX_TLS=tcp``, unless set), for machines without CUDA.

Usage: python bench/ucx_d2d.py [--sizes 64K,1M,16M] [--reps 3] [--json out.json]
       [--device cuda:0] [--alloc auto|torch|cupy] [--host-memory]
Exit status: 0 measured; 3 no CUDA device (and not --host-memory); 4 ucxx not importable;
1 anything else. The JSON is written in every case (``{"cuda": false, ...}`` without CUDA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from typing import Any

EXIT_NO_CUDA = 3
EXIT_NO_UCXX = 4
SIZES = {"64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20}
TAG_BASE = 0xD2D << 32


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text in SIZES:
        return SIZES[text]
    for suffix, shift in (("K", 10), ("M", 20), ("G", 30)):
        if text.endswith(suffix):
            return int(text[:-1]) << shift
    return int(text)


def label(size: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{suffix}"
    return str(size)


def cuda_state(device: str) -> tuple[bool, str]:
    """(usable, why not / what it is), without starting CUDA in this process when absent."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible (torch.cuda.is_available() is False)"
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return False, f"{device} requested but only {torch.cuda.device_count()} CUDA device(s) visible"
    return True, torch.cuda.get_device_name(index)


# --- buffers ------------------------------------------------------------------------------------
class Buffers:
    """Where the bytes live: CUDA (torch or cupy) or host (numpy)."""

    def __init__(self, host: bool, device: str, alloc: str):
        self.host, self.alloc = host, alloc
        self.index = int(device.split(":")[1]) if ":" in device else 0
        if not host:
            # UCX must find a CUDA context when its worker is made, or it cannot use the CUDA
            # transports: start it here, before make_worker.
            if alloc == "cupy":
                import cupy

                cupy.cuda.Device(self.index).use()
                cupy.zeros(1, cupy.uint8)
            else:
                import torch

                torch.cuda.set_device(self.index)
                torch.zeros(1, dtype=torch.uint8, device=f"cuda:{self.index}")

    def new(self, nbytes: int, fill: int) -> Any:
        if self.host:
            import numpy as np

            return np.full(nbytes, fill, dtype=np.uint8)
        if self.alloc == "cupy":
            import cupy

            return cupy.full(nbytes, fill, dtype=cupy.uint8)
        import torch

        return torch.full((nbytes,), fill, dtype=torch.uint8, device=f"cuda:{self.index}")

    def fill(self, buf: Any, value: int) -> None:
        if self.host or self.alloc == "cupy":
            buf.fill(value)
        else:
            buf.fill_(value)

    def ends(self, buf: Any) -> tuple[int, int]:
        """First and last byte (a device sync on CUDA)."""
        return int(buf[0]), int(buf[-1])

    def sync(self) -> None:
        if self.host:
            return
        if self.alloc == "cupy":
            import cupy

            cupy.cuda.Device(self.index).synchronize()
        else:
            import torch

            torch.cuda.synchronize(self.index)


def ucx_worker(host: bool) -> tuple[Any, Any, Any, Any]:
    """(libucxx, Array, context, worker), made as rlink's ucx plane makes its worker."""
    if host:
        os.environ.setdefault("UCX_TLS", "tcp")  # the host-memory loop goes over TCP loopback
    from rlink_ucx import Config
    from rlink_ucx.transport.ucx.learner import load_ucxx, make_worker

    u, context, worker = make_worker(Config.from_env(), loopback=True)  # RLINK_* settings apply, as for rlink
    return u, load_ucxx()[1], context, worker


# --- the sender (spawned) -----------------------------------------------------------------------
def _sender(address: bytes, host: bool, device: str, alloc: str, window: int, timeout: float, conn: Any) -> None:
    try:
        from peer_ucxx import ucx_wait  # the raw-ucxx row's progress loop (bench/peer_ucxx.py)

        buffers = Buffers(host, device, alloc)
        u, Array, _context, worker = ucx_worker(host)
        ep = u.UCXEndpoint.create_from_worker_address(worker, u.UCXAddress.create_from_buffer(address), False)
        conn.send(("ready", None))
        sources: dict[int, Any] = {}
        while True:
            order = conn.recv()  # (tag, size, count, fill) of one run, or None at the end
            if order is None:
                break
            tag, size, count, fill = order
            if size not in sources:
                sources[size] = buffers.new(size, fill)
            src = sources[size]
            buffers.fill(src, fill)
            buffers.sync()
            arr, utag = Array(src), u.UCXXTag(tag)
            inflight: list[Any] = []
            for _ in range(count):
                if len(inflight) >= window:
                    while not inflight[0].completed:
                        worker.progress()
                    inflight.pop(0).check_error()
                inflight.append(ep.tag_send(arr, utag))
            ucx_wait(worker, inflight, timeout, "sender")
            conn.send(("sent", count))
        ep.close_blocking(10**9, 1)  # completes while the receiver progresses its worker
    except BaseException:  # noqa: BLE001 - the receiver reports it
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


# --- the receiver (this process) ----------------------------------------------------------------
class Receiver:
    def __init__(self, host: bool, device: str, alloc: str, window: int, timeout: float):
        self.buffers = Buffers(host, device, alloc)
        self.u, self.Array, self._context, self.worker = ucx_worker(host)
        self.window, self.timeout = window, timeout
        self.slots: dict[int, list[tuple[Any, Any]]] = {}  # size -> [(buffer, Array)] * window

    def address(self) -> bytes:
        return bytes(self.worker.address.tobytes())

    def run(self, conn: Any, tag: int, size: int, count: int, fill: int) -> float:
        """One run of ``count`` messages of ``size`` bytes; returns bytes/s."""
        if size not in self.slots:
            self.slots[size] = []
            for _ in range(self.window):
                buf = self.buffers.new(size, 0)
                self.slots[size].append((buf, self.Array(buf)))
        slots = self.slots[size]
        for buf, _ in slots:
            self.buffers.fill(buf, 0)
        self.buffers.sync()
        utag = self.u.UCXXTag(tag)
        posted = min(self.window, count)
        requests = [self.worker.tag_recv(slots[i][1], utag) for i in range(posted)]
        conn.send((tag, size, count, fill))  # go
        warm = max(1, count // 20)
        done, t0, sent = 0, 0.0, None
        deadline = time.monotonic() + self.timeout
        worker = self.worker
        while done < count:
            i = done % self.window
            spins = 0
            while not requests[i].completed:
                worker.progress()
                spins += 1
                if spins % 4096 == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{label(size)}: {done} of {count} messages arrived within {self.timeout}s")
                    if sent is None and conn.poll():  # "sent" may come first (eager sends complete early)
                        sent = conn.recv()
                        if sent[0] != "sent":
                            raise RuntimeError(f"the sender failed:\n{sent[1]}")
            requests[i].check_error()
            done += 1
            if done == warm:
                t0 = time.perf_counter()
            if posted < count:
                requests[i] = worker.tag_recv(slots[i][1], utag)
                posted += 1
        elapsed = time.perf_counter() - t0
        if sent is None:
            if not conn.poll(self.timeout):
                raise TimeoutError(f"{label(size)}: the sender did not finish within {self.timeout}s")
            sent = conn.recv()
        if sent[0] != "sent":
            raise RuntimeError(f"the sender failed:\n{sent[1]}")
        for buf, _ in slots[: min(self.window, count)]:
            if self.buffers.ends(buf) != (fill, fill):
                raise RuntimeError(
                    f"{label(size)}: the received bytes are not the sender's ({self.buffers.ends(buf)} != {fill})"
                )
        return (count - warm) * size / elapsed if count > warm and elapsed > 0 else 0.0


def measure(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    receiver = Receiver(args.host_memory, args.device, args.alloc, args.window, args.timeout)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(receiver.address(), args.host_memory, args.device, args.alloc,
                                             args.window, args.timeout, theirs))  # fmt: skip
    proc.start()
    rows = []
    try:
        if not ours.poll(args.timeout):
            raise TimeoutError(f"the sender did not start within {args.timeout}s")
        kind, info = ours.recv()
        if kind != "ready":
            raise RuntimeError(f"the sender failed:\n{info}")
        for si, size in enumerate(sizes):
            count = max(20, min(args.max_messages, (args.total_mib << 20) // size))
            rates = []
            for rep in range(args.reps):
                fill = 1 + (si * 37 + rep * 11) % 254
                rates.append(receiver.run(ours, TAG_BASE | si << 16 | rep, size, count, fill))
            med = statistics.median(rates)
            rows.append({"size": label(size), "bytes": size, "messages": count, "gbps": med / 1e9,
                         "gbps_min": min(rates) / 1e9, "gbps_max": max(rates) / 1e9,
                         "reps": [r / 1e9 for r in rates]})  # fmt: skip
            print(f"{label(size):>6}  {med / 1e9:8.2f} GB/s  (min {min(rates) / 1e9:.2f}, max {max(rates) / 1e9:.2f}, "
                  f"{count} messages x {args.reps})", flush=True)  # fmt: skip
        ours.send(None)
        deadline = time.monotonic() + 30
        while proc.is_alive() and time.monotonic() < deadline:
            receiver.worker.progress()  # the sender's endpoint close needs our side to answer
            proc.join(0.001)
        if proc.exitcode != 0:
            raise RuntimeError(f"the sender exited with {proc.exitcode}")
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,1M,16M", help="message sizes (64K, 1M, 16M, or bytes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per run, in MiB (at least 20 messages)")
    parser.add_argument("--max-messages", type=int, default=20000, help="messages per run at most")
    parser.add_argument("--window", type=int, default=4, help="sends in flight / receives posted")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--alloc", choices=("auto", "torch", "cupy"), default="auto",
                        help="what allocates the CUDA buffers (auto: cupy where installed, else torch)")  # fmt: skip
    parser.add_argument("--host-memory", action="store_true", help="numpy host buffers over UCX TCP on loopback")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any single wait may take")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.alloc == "auto":
        args.alloc = "cupy" if importlib.util.find_spec("cupy") else "torch"
    out: dict[str, Any] = {
        "bench": "ucx_d2d",
        "memory": "host" if args.host_memory else "cuda",
        "device": "cpu" if args.host_memory else args.device,
        "alloc": None if args.host_memory else args.alloc,
        "window": args.window,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "rows": [],
    }

    def finish(code: int, message: str | None = None) -> int:
        if message:
            out["error"] = message
            print(f"ucx_d2d: {message}", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return code

    cuda, what = cuda_state(args.device)
    out["cuda"] = cuda
    out["gpu"] = what if cuda else None
    if not args.host_memory and not cuda:
        return finish(
            EXIT_NO_CUDA, f"{what}; nothing to measure device to device (--host-memory runs the loop on host buffers)"
        )
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx
    except ImportError as exc:
        out["ucxx"] = False
        return finish(EXIT_NO_UCXX, f"ucxx cannot be imported ({exc}); install ucxx-cu12 / ucxx-cu13")
    out["ucxx"] = ucxx.__version__
    out["ucx"] = ucxx.__ucx_version__
    if args.host_memory:
        os.environ.setdefault("UCX_TLS", "tcp")
    out["ucx_tls"] = os.environ.get("UCX_TLS", "(UCX default)")
    t0 = time.monotonic()
    try:
        out["rows"] = measure(args, sizes)
    except Exception as exc:  # noqa: BLE001 - one clear line plus the JSON, not only a traceback
        traceback.print_exc()
        return finish(1, f"failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    out["elapsed_s"] = round(time.monotonic() - t0, 2)
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())
