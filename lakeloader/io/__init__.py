"""Reading the lake through fsspec: few large requests, retried, one unit at a time."""
