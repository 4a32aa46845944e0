"""Versioned parameter fan-out: flat snapshots (``snapshot``), the learner's publisher, the
actor's double-buffered subscriber, the torch.distributed process groups they use (``group``),
which meet through a store relayed over the control channel (``rendezvous``), and the keyed
bucket tags every version carries (``mac``). It reaches sessions only through the small
protocols its modules define."""
