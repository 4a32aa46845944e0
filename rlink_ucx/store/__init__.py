"""The learner's store: the bounded receive ring that frames land in, and batch assembly
(gather into pinned staging, asynchronous device copies). It knows schemas, never transports."""
