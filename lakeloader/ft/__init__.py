"""Fault-tolerant training with torchft (extra ``ft``): a loader exact as replica groups change.

``loader`` is the :class:`FaultTolerantLoader`: one DataLoader re-sliced per quorum.
"""
