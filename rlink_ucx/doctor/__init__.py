"""``rlink doctor``: what this machine offers rlink (``checks``) and whether a running learner
answers as an actor would see it (``remote``)."""
