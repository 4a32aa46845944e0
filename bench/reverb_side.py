"""Reverb's uniform sampling of Atari-sized steps, for a side-by-side with ``rlink bench --suite replay``.

Runs in an interpreter that has ``dm-reverb`` and TensorFlow (they pin their own versions, so
keep them out of rlink's environment), e.g.::

    python3 -m venv /tmp/rvenv && /tmp/rvenv/bin/pip install dm-reverb==0.14.0 "tensorflow-cpu==2.15.*"
    /tmp/rvenv/bin/python bench/reverb_side.py --capacity 20000 --seconds 5

It starts an in-process Reverb server with one table (uniform sampler, FIFO remover,
``MinSize(1)``), inserts ``--capacity`` steps (obs uint8 84x84x4, action int64, reward
float32, done bool) as one item each, then samples batches of 256 for ``--seconds`` two ways:
``TrajectoryDataset`` through tf.data (``batch(256)``, Reverb's fast path) and
``Client.sample`` (the plain Python client). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    import reverb
    import tensorflow as tf

    spec = {
        "obs": tf.TensorSpec((84, 84, 4), tf.uint8),
        "action": tf.TensorSpec((), tf.int64),
        "reward": tf.TensorSpec((), tf.float32),
        "done": tf.TensorSpec((), tf.bool),
    }
    table = reverb.Table("replay", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                         max_size=args.capacity, rate_limiter=reverb.rate_limiters.MinSize(1),
                         signature=spec)  # fmt: skip
    server = reverb.Server([table])
    client = reverb.Client(f"localhost:{server.port}")
    rng = np.random.default_rng(0)
    step = {"obs": rng.integers(0, 255, (84, 84, 4), dtype=np.uint8), "action": np.int64(1),
            "reward": np.float32(1.0), "done": np.bool_(False)}  # fmt: skip
    started = time.perf_counter()
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        for _ in range(args.capacity):
            writer.append(step)
            writer.create_item("replay", 1.0, {k: writer.history[k][-1] for k in step})
        writer.flush()
    insert_s = time.perf_counter() - started

    ds = reverb.TrajectoryDataset.from_table_signature(server_address=f"localhost:{server.port}", table="replay",
                                                       max_in_flight_samples_per_worker=2 * args.batch)  # fmt: skip
    ds = ds.batch(args.batch, drop_remainder=True).prefetch(2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < args.seconds:
        next(it)
        n += 1
    tfdata = n / (time.perf_counter() - t)

    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < args.seconds:
        for _ in client.sample("replay", num_samples=args.batch, emit_timesteps=False):
            pass
        n += 1
    plain = n / (time.perf_counter() - t)
    print(json.dumps({"reverb": reverb.__version__ if hasattr(reverb, "__version__") else "0.14.0",
                      "capacity": args.capacity, "batch": args.batch,
                      "insert_steps_per_s": round(args.capacity / insert_s),
                      "tfdata_batches_per_s": round(tfdata, 1), "tfdata_items_per_s": round(tfdata * args.batch),
                      "client_batches_per_s": round(plain, 1), "client_items_per_s": round(plain * args.batch)}))  # fmt: skip
    server.stop()


if __name__ == "__main__":
    main()
