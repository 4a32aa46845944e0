"""Versioned parameter fan-out: flat snapshots (``snapshot``), the learner's publisher, the
actor's double-buffered subscriber (versions on the actor's own proven weights connection, or
from the learner's shared memory, ``shared``), the keyed bucket tags every version carries
(``mac``), and plain torch.distributed groups for the benchmark's baseline (``group``). It reaches sessions only through the small
protocols its modules define."""
