"""Thin adapters for the training frameworks people train with, each behind its own extra.

- :mod:`lakeloader.integrations.lightning`: what PyTorch Lightning cannot do with the plain
  loader (a state that stands before the batch it fetched ahead of its step).
- :mod:`lakeloader.integrations.transformers`: ``LakeTrainer``, a ``transformers.Trainer``
  over a :class:`~lakeloader.LakeDataset` or :class:`~lakeloader.Mixture`.
- :mod:`lakeloader.integrations.accelerate`: ``prepare(accelerator, loader)``.

Importing this package imports no framework; each module imports its own.
"""
