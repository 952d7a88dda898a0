"""A packed Mixture as a source of batches: each sample's source drawn by weight.

The mixture's cursor counts samples (the same on every rank); each source packs its own stream
as a packed lake does (:mod:`lakeloader.nodes.packing`). Its batches hold
``mixture.source_key`` too: each sample's source.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from lakeloader.dataset import LakeDataset
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.mixture import CursorNode
from lakeloader.nodes.packing import PackingNode
from lakeloader.nodes.streams import SourceStream, first_state, moved_to, stream_records
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.pipeline.packed_parts import arena_layout
from lakeloader.recovery.mixture_resume import MixtureResumption
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.packed_state import PackedMixtureState
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class PackedMixtureNode(CursorNode, PackingNode):
    """Packed samples of a Mixture with a packing: each sample's source drawn by weight.

    ``batch_size`` counts samples. ``state_dict()`` is the samples' cursor (a mixture's state,
    the same on every rank); ``load_state_dict`` continues under any world size and batch,
    and new weights or sources.
    """

    what = "packed mixture"
    _exact = True
    #: The samples' cursor.
    _mixed: MixtureState

    def _init(self, dataset: Any) -> None:
        """Take the mixture in."""
        assert isinstance(dataset, Mixture) and dataset.packing is not None
        self.mixture = self.dataset = dataset
        for ds in dataset.sources.values():
            self._check_column(ds)
        self._readers = {n: ds.reader() for n, ds in dataset.sources.items()}
        self._streams = {
            n: SourceStream(ds, size=self._samples_of) for n, ds in dataset.sources.items()
        }
        sources = stream_records(self._streams, {}, self._packing_hash)
        self._mixed = first_state(dataset, sources, self._topology())

    def _topology(self) -> dict[str, int]:
        """The run's shape as the state records it: rank 0's, so that every rank's is equal."""
        return {**self.host.topology.to_dict(), "rank": 0}

    def _counting(self) -> tuple[Callable[[LakeDataset], int], Callable[[LakeDataset], str] | None]:
        return self._samples_of, self._packing_hash

    @property
    def epoch(self) -> int:
        """0: each source runs through its own epochs (see ``state_dict()``)."""
        return 0

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        mix = self.mixture
        return self._decoding(arena_layout(list(mix.sources.values()), self._readers[mix.names[0]]))

    def _drawn(self) -> tuple[MixCursor, MixWeights, int]:
        at, mix = self._mixed, self.mixture
        return MixCursor(at.slot, at.counts), mix.weights, mix.seed

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from where the cursor stands."""
        sources = [self._source(n) for n in self.mixture.names]
        return self._begin(sources, self.mixture.batch_transform, self.mixture.source_key)

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        self._mixed = moved_to(self._mixed, self._streams, cursor, self._packing_hash)
        self.add_quarantine(skipped)

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the cursor (entries name their files)."""
        merged = tuple(merge(self._mixed.quarantine, entries))
        self._mixed = dataclasses.replace(self._mixed, quarantine=merged)
        self.tracker.quarantine = merged

    def _parse(self, state_dict: Any) -> MixtureState:
        """The cursor of a state (or of every rank's), their quarantines merged."""
        given = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
        states = [PackedMixtureState.from_dict(s).mixture for s in given]
        return dataclasses.replace(
            states[0], quarantine=tuple(merge(*(s.quarantine for s in states)))
        )

    def _resumed(self, resumed: MixtureResumption) -> None:
        for change in resumed.changes:
            logger.info("packed mixture resumed at sample %d: %s", resumed.state.slot, change)
        self._mixed = dataclasses.replace(resumed.state, topology=self._topology())
        self._restored()

    def _cursor_state(self) -> MixtureState:
        return self._mixed

    def _counted(self) -> Mapping[str, int]:
        return self._mixed.counts

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples' cursor: plain types, the same on every rank."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return PackedMixtureState(self._mixed).to_dict()
