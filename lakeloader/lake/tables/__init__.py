"""Lakehouse tables as sources: a Delta Lake or Iceberg table version is a pinned snapshot."""
