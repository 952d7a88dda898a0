"""The exactly-once audit: a ledger of delivered steps beside the checkpoints, and its proof.

``ledger`` writes the entries (``records``) as training runs; ``history`` proves from them that
every row of the committed history was trained on exactly once; ``lakeloader audit`` reports it.
"""
