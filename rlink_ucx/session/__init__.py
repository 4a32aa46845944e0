"""The control channel. ``actor/`` is the actor's connection to its learner (handshake, control
reader, reconnect and resume, the frame outbox, and the step writer); ``learner/`` is the
learner's listener, one session per actor (schema, credits, heartbeats, frame validation) and
fair credit grants. The two sides never import each other; ``tokens`` is what both share: the
token a learner generates and the same user's actors find."""
