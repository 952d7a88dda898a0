"""Fault-tolerant training with torchft (extra ``ft``): a loader exact as replica groups change.

``steps`` is the pure arithmetic of committed steps; ``loader`` the :class:`FaultTolerantLoader`.
"""
