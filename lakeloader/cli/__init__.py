"""The ``lakeloader`` command: ``plan``, ``inspect`` and ``demo``.

``main`` parses arguments, ``describe`` and ``inspect`` compute what ``plan`` and ``inspect``
show, ``demo`` runs the end-to-end job, ``tables`` formats text and JSON.
"""
