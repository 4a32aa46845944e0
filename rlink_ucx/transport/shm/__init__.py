"""The ``shm`` data plane: actor and learner on one host share a byte ring in memory
(``channel.py``, ``memory.py``, ``records.py``), the learner reads large payloads straight
from the actor's memory (``cma.py``) once the kernel shows the actor's process holds its
connection (``peer.py``); ``plane.py`` puts it behind the plane interface."""
