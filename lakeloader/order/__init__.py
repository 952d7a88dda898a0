"""The order of rows: pure functions of the snapshot, the seed, the epoch and a position.

``plan`` cuts an epoch into canonical partitions and windows; ``batches`` gives one rank its
share of global batches. Nothing here does I/O or knows how many workers there are.
"""
