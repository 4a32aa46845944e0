"""The ``ucx`` data plane on ucxx: the learner's worker (``learner.py``, ``generation.py``), the
actor's endpoint (``actor.py``), UCX setup and probing (``setup.py``, ``probe.py``), strangers'
messages thrown away (``unexpected.py``); ``plane.py`` puts it behind the plane interface."""
