"""A packed Mixture as a source of batches: each sample's source drawn by weight.

The mixture's cursor counts samples (the same on every rank); each source packs its own stream
as a packed lake does (:mod:`lakeloader.nodes.packing`). Its batches hold
``mixture.source_key`` too: each sample's source.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from lakeloader.checkpoint.barrier import Position
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import decoding_setup
from lakeloader.nodes.mixture import first_state, resume_streams, stream_records
from lakeloader.nodes.packing import PackingNode
from lakeloader.nodes.streams import SourceStream, moved_streams, pinned_datasets
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.pipeline.packed_parts import arena_layout
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.packed_state import PackedMixtureState
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class PackedMixtureNode(PackingNode):
    """Packed samples of a Mixture with a packing: each sample's source drawn by weight.

    ``batch_size`` counts samples. ``state_dict()`` is the samples' cursor (a mixture's state,
    the same on every rank); ``load_state_dict`` continues under any world size and batch,
    and new weights or sources.
    """

    what = "packed mixture"

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
        self._mixed = PackedMixtureState(first_state(dataset, sources, self._topology()))

    def _topology(self) -> dict[str, int]:
        """The run's shape as the state records it: rank 0's, so that every rank's is equal."""
        return {**self.host.topology.to_dict(), "rank": 0}

    @property
    def epoch(self) -> int:
        """0: each source runs through its own epochs (see ``state_dict()``)."""
        return 0

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        mix = self.mixture
        layout = arena_layout(list(mix.sources.values()), self._readers[mix.names[0]])
        sources = [(ds, self._readers[n], layout) for n, ds in mix.sources.items()]
        return decoding_setup(self.host, sources, mix.seed)

    def _drawn(self) -> tuple[MixCursor, MixWeights, int]:
        at, mix = self._mixed.mixture, self.mixture
        return MixCursor(at.slot, at.counts), mix.weights, mix.seed

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from where the cursor stands."""
        sources = [self._source(n) for n in self.mixture.names]
        return self._begin(sources, self.mixture.batch_transform, self.mixture.source_key)

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        for name, stream in self._streams.items():
            stream.forget_before(cursor.counts.get(name, 0))
        at = self._mixed.mixture
        records = stream_records(self._streams, cursor.counts, self._packing_hash)
        sources, counts = {**at.sources, **records}, dict(cursor.counts)
        at = dataclasses.replace(at, slot=cursor.slot, counts=counts, sources=sources)
        self._mixed = PackedMixtureState(at)
        self.add_quarantine(skipped)

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the cursor (entries name their files)."""
        mixture = self._mixed.mixture
        merged = tuple(merge(mixture.quarantine, entries))
        self._mixed = PackedMixtureState(dataclasses.replace(mixture, quarantine=merged))
        self.tracker.quarantine = merged

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from a state (any rank's; a list of every rank's is taken too).

        Raises:
            StateFormatError: If it is not a packed mixture's state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one.
        """
        self._resume_cursor(self._saved_cursor(state_dict), {})

    def _saved_cursor(
        self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> MixtureState:
        """The cursor of a state (or of every rank's), their quarantines merged."""
        given = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
        states = [PackedMixtureState.from_dict(s).mixture for s in given]
        return dataclasses.replace(
            states[0], quarantine=tuple(merge(*(s.quarantine for s in states)))
        )

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint on the lakes of now, as a Mixture's loader does.

        Raises:
            StateFormatError: If it holds another kind of loader's state.
            LakeChangedError: Under ``"error"``, when a source's saved epoch needs files gone.
        """
        saved = self._saved_cursor(dict(ckpt.state_dict))
        sources, size, config = self.mixture.sources, self._samples_of, self._packing_hash
        self._resume_cursor(
            saved, moved_streams(ckpt, coordinator, saved, sources, size, config, True)
        )

    def _resume_cursor(self, saved: MixtureState, moved: Mapping[str, SourceStream]) -> None:
        """Continue from ``saved``; the ``moved`` sources' streams are the coordinator's."""
        self.host._close_iterator("load_state_dict()")
        size, config = self._samples_of, self._packing_hash
        mixture, self._streams, resumed = resume_streams(self.mixture, saved, moved, size, config)
        self.mixture = self.dataset = mixture  # a re-sliced loader is made on it, too
        for change in resumed.changes:
            logger.info("packed mixture resumed at sample %d: %s", resumed.state.slot, change)
        self._mixed = PackedMixtureState(
            dataclasses.replace(resumed.state, topology=self._topology())
        )
        self._restored()

    def _counted(self) -> Mapping[str, int]:
        return self._mixed.mixture.counts

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: the samples' cursor."""
        return self._mixed.mixture

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source, of the epoch its count stands in."""
        return pinned_datasets(self._streams, self._mixed.mixture.counts, self.mixture.sources)

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples' cursor: plain types, the same on every rank."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return self._mixed.to_dict()
