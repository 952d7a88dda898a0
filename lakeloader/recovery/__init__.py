"""The recovery coordinator: a saved position onto the lake of now; dead workers' work.

``coordinator`` is the ``RecoveryCoordinator``; ``lake_changes`` compares a pinned snapshot
with the lake as it is now, and ``reassign`` decides what a dead worker's work becomes.
"""
