"""Reading the lake through fsspec: few large requests, retried, one unit at a time.

``retry`` tells transient failures from definitive ones and retries until a deadline,
``fetch`` makes one ranged GET per footer and coalesced ranged GETs per unit, and ``reader``
decodes a unit (a row group, or a row range of one) into the snapshot's schema.
"""
