"""Rank coordination of a job of many learners: the job's ranks and rank token (``job.py``),
rank 0's placement of actors on ranks (``placement.py``), and another rank's link to rank 0
(``link.py``)."""
