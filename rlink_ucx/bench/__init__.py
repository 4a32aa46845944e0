"""The benchmark harness behind ``rlink bench``: rlink against the physical limits (memcpy, a
raw socket) and its peers on the same workloads. The library core never imports it."""
