"""Trace simulator: replays openb traces through the placement policies as the FGD paper's
artifact did (see ``replay`` for how it stays fast and ``trace`` for the arrival order)."""
