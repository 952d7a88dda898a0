"""The reader state: where the training loop stands, and the units skipped for good.

``loader_state`` is the versioned plain-data state, ``tracker`` the ``ReaderStateTracker`` that
holds it and derives where every rank and worker stands, ``quarantine`` the skipped units.
"""
