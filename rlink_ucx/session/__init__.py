"""The control channel, both sides of it.

Learner side (``learner_*``): the listener and handshakes, one ``LearnerSession`` per actor
(schema, credits, heartbeats, frame validation), fair credit grants, and the stats report.
Actor side (``actor_*``): the connection to the learner (handshake, control reader,
reconnect and resume, the frame outbox), and the writer that coalesces steps into frames.
"""
