"""The replay: the queue between the rollout workers and the learner (``queue.py``: the pure ``ReplayCore``,
admission, staleness and accounting, and the ``ReplayQueue`` Ray actor around it). Imports only the wires."""
