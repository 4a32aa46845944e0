"""The ``tcp`` data plane: a second TCP connection per actor (``stream.py``), behind the plane
interface (``plane.py``)."""
