"""What a lake is: its data files, their frozen description, one schema, the manifest.

``discovery`` lists the files, ``snapshot`` reads their footers into a pinned, fingerprinted
``Snapshot``, ``schema`` unifies their schemas, and ``manifest`` turns a snapshot into the plain
data that a checkpoint pins.
"""
