"""Where the suite finds its peer rows: the harnesses in ``bench/`` of a source checkout.

The peer harnesses (``bench/peer_ucxx.py``, ``peer_zmq.py``, ``peer_gloo.py``, ``peer_ray.py``)
only compare rlink with other systems, so the wheel leaves them out; from an installed wheel
their rows are skipped with a line that says where to get them. They are imported by module
name once ``bench/`` is on ``sys.path`` (appended, so nothing already importable is shadowed);
the spawned sender processes inherit that path.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from .common import SOURCE_ROOT

BENCH_DIR = os.path.join(SOURCE_ROOT, "bench")  # a checkout's bench/, beside rlink_ucx/
CHECKOUT = "run rlink bench from a source checkout (git clone; pip install -e '.[bench]')"


def missing(module: str) -> str | None:
    """Why peer harness ``module`` cannot run here, or None."""
    if not os.path.isfile(os.path.join(BENCH_DIR, module + ".py")):
        return f"bench/{module}.py is not in the installed wheel: {CHECKOUT}"
    return None


def load(module: str) -> ModuleType:
    """Import peer harness ``module`` from ``bench/``; ImportError naming the checkout if it is not there."""
    reason = missing(module)
    if reason is not None:
        raise ImportError(reason)
    if BENCH_DIR not in sys.path:
        sys.path.append(BENCH_DIR)
    return importlib.import_module(module)


def shutdown() -> None:
    """Stop what a peer left running across rows (Ray's local instance), if it was loaded."""
    ray = sys.modules.get("peer_ray")
    if ray is not None:
        ray.ray_shutdown()
