"""The order of rows: pure functions of the snapshot, the seed, the epoch and a position.

Nothing here does I/O or knows how many workers there are.
"""
