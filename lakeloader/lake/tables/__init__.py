"""Lakehouse tables as sources: a Delta Lake or Iceberg table version is a pinned snapshot.

A table version lists its data files, their row counts and partition values in its own
metadata (no listing), deletes rows without rewriting files (Delta deletion vectors, Iceberg
position deletes) and renames columns without rewriting them (field ids). :mod:`.files` turns
such a listing into a :class:`~lakeloader.lake.snapshot.Snapshot`; :mod:`.delta` and
:mod:`.iceberg` read the listings; :mod:`.options` turns fsspec storage options into those of
each table library.
"""
