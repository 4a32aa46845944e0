"""The learner's store: the bounded receive ring that frames land in, and batch assembly
(gather into pinned staging, asynchronous device copies). ``replay/`` keeps steps to sample
them again. It knows schemas, never transports."""
