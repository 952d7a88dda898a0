"""``MixtureLoader``: what ``lakeloader.DataLoader(mixture, ...)`` is.

It takes torch's arguments like the single-lake loader. Each ``for batch in loader`` is one
pass of ``mixture.epoch_rows`` rows (full global batches; the sources' own epochs run apart);
``state_dict()`` is a :class:`~lakeloader.state.mixture_state.MixtureState`, O(sources), and
``load_state_dict()`` continues under any world size, batch size or worker count, with the
weights and sources of the mixture it is given (:mod:`lakeloader.recovery.mixture_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from lakeloader.cache.packed import RowLayout
from lakeloader.dataset import LakeDataset
from lakeloader.loader import LOADER_FOR, DataLoader
from lakeloader.loader_args import check_stream_options, refuse_fetched_ahead
from lakeloader.loader_position import StatePosition
from lakeloader.mixture import Mixture
from lakeloader.order.mixture import MixCursor
from lakeloader.pipeline.mixing import MixtureIterator
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.recovery.mixture_resume import records, resume_mixture
from lakeloader.state.mixture_state import MixtureState, WeightChange
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class MixtureLoader(StatePosition, DataLoader):
    """Streams batches of a :class:`~lakeloader.Mixture` (see the module docstring).

    Every batch holds ``mixture.source_key``: the source of each row, an index into
    ``mixture.names``. With ``num_workers > 0``, worker processes decode every source's row
    groups (else this process's ``io_threads`` do). A pass that ends at its last step leaves
    its sources' decoded row groups to the next pass, which goes on with them (released by
    ``close()``, ``load_state_dict()``, or when the loader is collected). A user
    ``collate_fn`` is not supported for a mixture.
    """

    dataset: Any  # the Mixture (the single-lake loader's is a LakeDataset)

    def _init_dataset(self, dataset: LakeDataset | Mixture) -> None:
        assert isinstance(dataset, Mixture)
        check_stream_options(self.options, "a Mixture")
        self.mixture = self.dataset = dataset
        self._cursor: MixCursor | None = None
        self._stored: MixtureState
        self._readers = [dataset.sources[n].reader() for n in dataset.names]
        first = WeightChange(0, dict(dataset.raw_weights))
        self._state = MixtureState(
            seed=dataset.seed,
            slot=0,
            counts={n: 0 for n in dataset.names},
            history=(first,),
            epoch=0,
            epoch_start=0,
            epoch_rows=dataset.epoch_rows,
            sources=records(dataset),
            topology=self.topology.to_dict(),
        )
        self._res = LoaderResources(self)

    @property
    def _state(self) -> MixtureState:
        """The position: the last state set, moved to the cursor of the last batch delivered."""
        if self._cursor is not None:
            cursor, self._cursor = self._cursor, None
            self._stored = dataclasses.replace(
                self._stored, slot=cursor.slot, counts=dict(cursor.counts)
            )
        return self._stored

    @_state.setter
    def _state(self, state: MixtureState) -> None:
        self._stored, self._cursor = state, None

    def _pass_steps(self) -> int:
        """Steps in a whole pass over the mixture for this topology."""
        return -(-self._state.epoch_rows // self.global_batch_size)

    @property
    def epoch(self) -> int:
        """The pass over the mixture under way (or just finished)."""
        return self._state.epoch

    def steps_left(self) -> int:
        """Global steps left in the pass under way, for the topology of now."""
        state = self._state
        rows = state.epoch_rows - (state.slot - state.epoch_start)
        return -(-max(rows, 0) // self.global_batch_size)

    def set_epoch(self, epoch: int, *, restart: bool = False) -> None:
        """Accepted for the usual epoch loop: a mixture's stream goes on from where it is.

        Raises:
            ValueError: If ``epoch`` is neither the pass under way nor the next one, or with
                ``restart=True`` (a mixture's sources cannot be rewound).
        """
        state = self._state
        if restart or epoch not in (state.epoch, state.epoch + 1):
            raise ValueError(
                f"a mixture streams on: set_epoch({epoch}) while in pass {state.epoch} "
                "(only that pass or the next, and no restart, can be asked for)"
            )
        if epoch == state.epoch + 1 and not state.epoch_done:
            logger.info(
                "pass %d left early: pass %d starts at slot %d", state.epoch, epoch, state.slot
            )
        if epoch != state.epoch:
            self._close_iterator("set_epoch()")
            self._state = _next_pass(state)

    def _placed(self, topology: Topology) -> None:
        """Nothing to do: a pass takes the topology when it starts."""

    def _pass(self) -> Iterator[Any]:
        self._close_iterator("a newer iter(loader)")
        if self._state.epoch_done:
            self._state = _next_pass(self._state)
        res = self._res
        state, size = self._state, self.global_batch_size
        cursor = MixCursor(state.slot, state.counts)
        sources = res.take_carried()
        if not isinstance(sources, Stores) or sources.at != cursor:
            if sources is not None:
                sources.close()
            unit_dir = res.unit_folder(self.options.cache_dir, self.options.cache_bytes)
            pool = self._ensure_pool() if self.num_workers else None
            sources = Stores(
                self._leaves(),
                self.options,
                Topology(1, 0, 0, self.batch_size),
                unit_dir,
                pool,
                RowLayout.of(self._readers[0].schema),
                workers_decode=True,
            )
        left = state.epoch_rows - (state.slot - state.epoch_start)
        it = MixtureIterator(
            self.mixture,
            self.mixture.weights,
            cursor,
            -(-left // size),
            self.topology,
            self.options,
            sources,
            self._delivered,
            res.carry,
        )
        res.iterator = it
        return it

    def _leaves(self) -> list[Leaf]:
        """Each source's lake and reader, in the order of the mixture's names."""
        sources = [self.mixture.sources[n] for n in self.mixture.names]
        return [
            Leaf(ds, r, (), BatchRecipe(lists=ds.list_format))
            for ds, r in zip(sources, self._readers, strict=True)
        ]

    def _worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units, packed as one arena's rows."""
        layout = RowLayout.of(self._readers[0].schema)
        named = zip(self.mixture.names, self._readers, strict=True)
        return self._decoding_setup(
            [(self.mixture.sources[n], r, layout) for n, r in named], self.mixture.seed
        )

    def _delivered(self, cursor: MixCursor) -> None:
        """The only place the position moves: a batch was handed over."""
        self._cursor = cursor  # the state is made of it when asked for (not at every step)

    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """The mixture's position: plain types, O(sources)."""
        refuse_fetched_ahead(fetched_ahead, "a mixture")
        return self._state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a mixture state taken under any topology.

        The weights and sources are this mixture's: changes are recorded in the state and
        logged.

        Raises:
            StateFormatError: If the dict is not a mixture state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one.
        """
        self._close_iterator("load_state_dict()")
        self._res.drop_carried()
        resumed = resume_mixture(MixtureState.from_dict(state_dict), self.mixture)
        for change in resumed.changes:
            logger.info("mixture resumed at slot %d: %s", resumed.state.slot, change)
        self._state = dataclasses.replace(resumed.state, topology=self.topology.to_dict())

    def barrier_position(self) -> MixtureState:
        """What the checkpoint barrier compares across ranks (the same on every rank)."""
        return self._state

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state a checkpoint holds (every rank's is the same; no unit is quarantined)."""
        return self._state.to_dict()

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source."""
        return dict(self.mixture.sources)

    @property
    def quarantine(self) -> list[Any]:
        """Mixtures skip no unit (their sources read with ``on_error="raise"``)."""
        return []

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks (cumulative over the loader's life)."""
        it = self._res.iterator
        counters = [r.counters for r in self._readers]
        return {
            "units_decoded": sum(c.units_decoded for c in counters),
            "bytes_read": sum(c.bytes_read for c in counters),
            "requests": sum(c.requests for c in counters),
            # Between passes, the sources the last one left hold what the next will use.
            "cache_bytes": it.cache_bytes() if it is not None else self._res.carried_bytes(),
            "cache_peak_bytes": it.cache_peak_bytes() if it is not None else 0,
        }


def _next_pass(state: MixtureState) -> MixtureState:
    """The state at the start of the next pass (where the last one ended)."""
    return dataclasses.replace(state, epoch=state.epoch + 1, epoch_start=state.slot)


LOADER_FOR["mixture"] = MixtureLoader
