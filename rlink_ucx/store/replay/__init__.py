"""Replay on the learner: a preallocated FIFO table (host or device), its samplers (uniform,
prioritized, FIFO), Reverb's samples-per-insert rate limiter, the inserter that takes steps from
the receive ring, and pickle-free checkpoints."""
