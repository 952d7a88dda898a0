"""The sources of a loader's batches, as nodes of one protocol (:mod:`lakeloader.nodes.base`).

:func:`as_node` is the only place that looks at what a dataset is.
"""

from __future__ import annotations

from typing import Any

from lakeloader.dataset import LakeDataset
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import Host, Node
from lakeloader.nodes.lake import LakeNode
from lakeloader.nodes.mixture import MixtureNode
from lakeloader.nodes.packing import PackedMixtureNode, PackingNode


def as_node(host: Host, dataset: Any) -> Node:
    """The node that reads ``dataset`` for ``host``.

    Raises:
        TypeError: If ``dataset`` is neither a :class:`LakeDataset` nor a :class:`Mixture`.
    """
    if isinstance(dataset, Mixture):
        return PackedMixtureNode(host, dataset) if dataset.packing else MixtureNode(host, dataset)
    if isinstance(dataset, LakeDataset):
        return PackingNode(host, dataset) if dataset.packing else LakeNode(host, dataset)
    raise TypeError(
        f"dataset must be a lakeloader.LakeDataset or Mixture, got {type(dataset).__name__}"
    )


__all__ = ["Host", "LakeNode", "MixtureNode", "Node", "PackedMixtureNode", "PackingNode", "as_node"]
