"""What the learner tells its operator: plain counters and histograms, ``stats()``'s report and
the optional Prometheus endpoint. Reads state it is handed; never changes it."""
