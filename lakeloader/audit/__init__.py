"""The exactly-once audit: a ledger of delivered steps beside the checkpoints, and its proof."""
