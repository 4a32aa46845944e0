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
# One pytest process runs hundreds of learners: what one test's first batch froze out of the
# garbage collector (Config.gc_freeze) would outlive that test. The freeze itself is tested in
# fresh interpreters (tests/integration/test_gc_freeze.py).
os.environ["RLINK_GC_FREEZE"] = "0"


def ucx_importable() -> bool:
    from rlink_ucx.transport import ucx_available

    return ucx_available()


def shm_possible() -> bool:
    from rlink_ucx.transport.shm import channel as shm
    return shm.available()


TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")),
    pytest.param("shm", marks=pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")),
]



def _listening(port: int) -> bool:
    """Whether something listens on ``port`` of loopback (a live learner keeps its token file)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture(scope="session", autouse=True)
def _no_stale_token_files():
    """Learners the tests SIGKILL leave their generated token files behind (a killed process
    cannot remove them): remove the ones this run added whose port nothing listens on any more,
    so `rlink doctor` does not list them afterwards."""
    from rlink_ucx import Config
    from rlink_ucx.session.tokens import token_dirs

    dirs = [d for d in token_dirs(Config()) if d.is_dir() or not d.exists()]
    before = {p for d in dirs if d.is_dir() for p in d.glob("*.token")}
    yield
    for d in dirs:
        if not d.is_dir():
            continue
        for path in d.glob("*.token"):
            if path not in before and path.stem.isdigit() and not _listening(int(path.stem)):
                path.unlink(missing_ok=True)


@pytest.fixture
def weights_over_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights go to actors over their weights streams, the path of actors on other hosts:
    actors on the learner's host would read its shared memory instead (test_weights_shared.py).
    For test files about that path: ``pytestmark = pytest.mark.usefixtures("weights_over_connections")``."""
    from rlink_ucx.weights import snapshot

    monkeypatch.setattr(snapshot, "shared_available", lambda: False)  # learners made here
    monkeypatch.setenv("RLINK_WEIGHTS_SHARED_MEMORY", "0")  # learners and actors in other processes
