"""TensorFlow arrays from rlink's buffers: an array that does not start on a 64-byte boundary
(a params leaf at an odd offset of the received buffer) is copied, not handed to TensorFlow as a
DLPack view, on which its kernels abort the whole process (`Check failed: IsAligned()`). Run in
a child process, since the failure is an abort."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import numpy as np
import tensorflow as tf
from rlink_ucx.wire.frameworks import adapter, aligned
buf = aligned((4 * 17 + 64,), np.uint8)
tf_adapter = adapter("tensorflow")
for offset in (1, 3, 16):  # 4, 12 and 64 bytes past a 64-byte boundary
    view = np.frombuffer(buf.data, np.float32)[offset:offset + 16].reshape(4, 4)
    view[...] = np.arange(16, dtype=np.float32).reshape(4, 4) + offset
    t = tf_adapter.array(view, "float32")
    print(offset, float(tf.reduce_sum(tf.matmul(t, t))) == float((view @ view).sum()))
"""


@pytest.mark.timeout(180)
def test_an_unaligned_array_reaches_tensorflow_as_a_copy_that_its_kernels_take():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:3] == ["1 True", "3 True", "16 True"], proc.stdout
