"""The learner side of the control channel: the listener, one session per actor, credit grants."""
