"""The checkpoint manager: the reader state serialised at sync barriers under one URL.

``manager`` saves and loads, ``barrier`` makes ranks agree before a save, and ``layout`` is
the on-disk format (names and typed records).
"""
