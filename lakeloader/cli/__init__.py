"""The ``lakeloader`` command: ``plan``, ``inspect``, ``audit``, ``clean`` and ``demo``."""
