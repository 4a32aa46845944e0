"""The benchmark harness behind ``rlink bench``: rlink against the physical limits (memcpy, a
raw socket) on the same workloads, the fan-out, scale and replay suites, and the loader of the
peer rows. The library core never imports it.

The peer harnesses (raw ucxx, pyzmq, torch-gloo, Ray, Reverb) and the standalone scripts live
in ``bench/`` of a source checkout, outside the wheel (peers.py says how the suite finds them).

It uses the public API (``rlink_ucx.__all__``, ``RLinkDataset``) and only these internals:
``rlink_ucx.transport.shm.channel`` (``available``: whether the shm rows can run here). Its own
``process_group`` builds the plain torch.distributed groups of the gloo baselines (the fan-out's
plain broadcast, ``bench/peer_gloo.py``). The replay suite (replay.py) also feeds
``rlink_ucx.store.ring.StepRing`` by hand and reads ``ReplayDataset._core`` (the table and sum
tree it fills and times).
"""
