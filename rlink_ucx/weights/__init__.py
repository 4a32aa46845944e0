"""Versioned parameter fan-out: flat snapshots (``snapshot``), the learner's publisher, the
actor's double-buffered subscriber, and the torch.distributed process groups they use
(``group``). It reaches sessions only through the small protocols its modules define."""
