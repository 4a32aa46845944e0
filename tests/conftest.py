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

