"""Versioned parameter fan-out: flat snapshots (``snapshot``), the learner's publisher, the
actor's double-buffered subscriber (versions on the actor's own proven weights stream, or from
the learner's shared memory, ``shared``), the one decision of which of the two each actor gets
for each version (``route``), and the keyed bucket tags every version carries (``mac``). It
reaches sessions only through the small protocols its modules define."""
