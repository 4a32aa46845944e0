import faulthandler
import os

import pytest

faulthandler.enable()
try:
    # Compile hypothesis' report module before any test runs: CPython 3.11.7 can fail to compile
    # it later ("AST constructor recursion depth mismatch", cpython#106905) once a test has moved
    # the recursion limit, which crashed pytest's summary after subsets without the fuzz tests.
    import hypothesis.internal.observability  # noqa: F401
except ImportError:  # hypothesis comes with the test extra
    pass
# Tests must never depend on the developer's environment.
for name in list(os.environ):
    if name.startswith("RLINK_"):
        del os.environ[name]


def ucx_importable() -> bool:
    from rlink_ucx.transport import ucx_available

    return ucx_available()


def shm_possible() -> bool:
    from rlink_ucx.transport import shm

    return shm.available()


TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")),
    pytest.param("shm", marks=pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")),
]

