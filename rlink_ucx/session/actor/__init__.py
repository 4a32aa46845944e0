"""The actor side of the control channel: one connection to the learner and the step writer."""
