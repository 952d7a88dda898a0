"""The ``lakeloader`` command: ``plan``, ``inspect``, ``audit``, ``clean`` and ``demo``.

``parser`` holds the arguments, ``main`` runs the subcommands and turns errors into one line;
``describe`` and ``inspect`` compute what ``plan`` and ``inspect`` show, ``checkpoints`` finds
the checkpoint a path names (or says what the path is instead), ``audit`` proves exactly-once
delivery, ``demo`` runs the end-to-end job, ``tables`` formats text and JSON.
"""
