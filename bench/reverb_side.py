"""Reverb's side of the replay side-by-side; see rlink_ucx/bench/reverb_side.py. It runs in an
interpreter that has dm-reverb and TensorFlow (not rlink), so it runs that file by its path."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(
        str(Path(__file__).resolve().parents[1] / "rlink_ucx" / "bench" / "reverb_side.py"), run_name="__main__"
    )
