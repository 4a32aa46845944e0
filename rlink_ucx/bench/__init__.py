"""The benchmark harness behind ``rlink bench``: rlink against the physical limits (memcpy, a
raw socket) and its peers on the same workloads. The library core never imports it.

It uses the public API (``rlink_ucx.__all__``, ``RLinkDataset``) and only these internals:
``rlink_ucx.transport.ucx`` (``load_ucxx``, ``make_worker``: the raw-ucxx baseline gets a worker
made like rlink's), ``rlink_ucx.weights.group`` (process groups of the gloo baselines) and
``rlink_ucx.transport.shm`` (``available``: whether the shm rows can run here). The replay
suite (replay.py) also feeds ``rlink_ucx.store.ring.StepRing`` by hand and reads
``ReplayDataset._core`` (the table and sum tree it fills and times).
"""
