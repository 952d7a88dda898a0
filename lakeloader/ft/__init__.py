"""Fault-tolerant training with torchft (extra ``ft``): :class:`~.loader.FaultTolerantLoader`."""
