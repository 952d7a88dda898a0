"""Where a mixture or a packed stream leaves every source and rank (``DataLoader.view()``).

Pure functions of a stream node's position, its weights and the topology: nothing is read. A
packed source's next sample is located by the unit its first token is in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from lakeloader.dataset import LakeDataset
from lakeloader.nodes.streams import SourceStream
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import TokenStream, step_shares
from lakeloader.order.plan import rank_bounds
from lakeloader.pipeline.packed_parts import token_stream
from lakeloader.state.tracker import ReaderStateTracker, ReaderView
from lakeloader.state.view import Location, RankView, SourceView, locate
from lakeloader.topology import Topology

#: Where offset ``position`` of epoch ``epoch`` of a source's dataset lives.
Where = Callable[[LakeDataset, int, int], Location]


def row_at(ds: LakeDataset, epoch: int, position: int) -> Location:
    """Where row ``position`` of a lake's ``epoch`` lives."""
    return locate(ds.plan(epoch), ds.snapshot, np.array([position]))[0]


def _epoch_of(stream: SourceStream, offset: int) -> tuple[int, int] | None:
    """The epoch of ``offset`` of a source's stream and its place in it (None: not known yet)."""
    if not stream.covers(offset):
        return None
    epoch, place = stream.locate(np.array([offset], dtype=np.int64))
    return int(epoch[0]), int(place[0])


def source_views(
    streams: Mapping[str, SourceStream], counts: Mapping[str, int], where: Where
) -> tuple[SourceView, ...]:
    """Where each source stands: its epoch, the rows (samples) of it given, and its next one.

    A followed lake's source whose next rows are not in yet stands at the end of the last
    increment known, with no location.
    """
    out = []
    for name, stream in streams.items():
        count = counts.get(name, 0)
        found = _epoch_of(stream, count)
        if found is None:
            epoch, start, ds = stream.known[-1]
            out.append(SourceView(name, epoch, count - start, stream.size(ds), None))
            continue
        epoch, place = found
        ds = stream.dataset(epoch)
        out.append(SourceView(name, epoch, place, stream.size(ds), where(ds, epoch, place)))
    return tuple(out)


def mixture_view(
    tracker: ReaderStateTracker, streams: Mapping[str, SourceStream], cursor: MixCursor,
    weights: MixWeights, seed: int, topology: Topology, steps: int,
) -> ReaderView:  # fmt: skip
    """A mixture's view: its pass, each rank's next share and its first row, each source.

    A rank's share of a step is contiguous slots of the step's draw; at the pass's end, as at a
    lake's epoch's, every rank has no share.
    """
    size = topology.global_batch
    draw, _ = cursor.take(weights, seed, size)
    ranks = []
    for rank in range(topology.world_size):
        lo, hi = rank_bounds(size, topology.world_size, rank) if steps else (0, 0)
        at = None
        if hi > lo:
            stream = streams[weights.names[int(draw.sources[lo])]]
            found = _epoch_of(stream, int(draw.offsets[lo]))
            if found is not None:
                at = row_at(stream.dataset(found[0]), *found)
        ranks.append(RankView(rank, hi - lo, at))
    pass_rows = tracker.position + size * steps  # the pass's rows: whole global batches
    return _view(tracker, pass_rows, steps, ranks, source_views(streams, cursor.counts, row_at))


def packed_view(
    tracker: ReaderStateTracker, streams: Mapping[str, SourceStream], cursor: MixCursor,
    weights: MixWeights, seed: int, topology: Topology,
    counts_of: Callable[[LakeDataset], np.ndarray], seq_len: int,
) -> ReaderView:  # fmt: skip
    """A packed stream's view: the samples delivered, each rank's next share, each source.

    A rank's share is located where its first sample begins; ranks have no location while a
    followed lake's next samples are not in.
    """
    made: dict[tuple[str, int], TokenStream] = {}

    def tokens_of(ds: LakeDataset, epoch: int) -> TokenStream:
        key = (ds.fingerprint, epoch)
        if key not in made:
            made[key] = token_stream(ds, epoch, counts_of(ds), seq_len)
        return made[key]

    def where(ds: LakeDataset, epoch: int, position: int) -> Location:
        """Where sample ``position`` of an epoch begins: its first token's unit."""
        tokens = tokens_of(ds, epoch)
        first = int(tokens.spans(*tokens.locate(np.array([position])))[0][0])
        unit = int(ds.plan(epoch).order[tokens.units(first, first + 1)[0]])
        u, f = ds.units, int(ds.units.file_index[unit])
        path = ds.snapshot.files[f].path
        return Location(None, f, path, int(u.row_group[unit]), int(u.row_start[unit]))

    size = topology.global_batch
    draw, _ = cursor.take(weights, seed, size)
    ordered = [streams[n] for n in weights.names]
    found = [
        _epoch_of(ordered[int(s)], int(o)) for s, o in zip(draw.sources, draw.offsets, strict=True)
    ]
    bounds = [rank_bounds(size, topology.world_size, r) for r in range(topology.world_size)]
    ranks = [RankView(r, hi - lo, None) for r, (lo, hi) in enumerate(bounds)]
    known = [f for f in found if f is not None]
    if len(known) == len(found):
        epochs = np.array([e for e, _ in known], dtype=np.int64)
        places = np.array([p for _, p in known], dtype=np.int64)
        pairs = {(int(s), int(e)) for s, e in zip(draw.sources, epochs, strict=True)}
        stream_of = {(s, e): tokens_of(ordered[s].dataset(e), e) for s, e in pairs}
        for rank in range(topology.world_size):
            (share,) = step_shares(
                draw.sources, draw.offsets, epochs, places, stream_of, size,
                topology.world_size, rank,
            )  # fmt: skip
            if len(share):
                stream = ordered[int(share.source[0])]
                epoch, place = stream.locate(share.offset[:1])
                at = where(stream.dataset(int(epoch[0])), int(epoch[0]), int(place[0]))
                ranks[rank] = RankView(rank, len(share), at)
    return _view(tracker, None, None, ranks, source_views(streams, cursor.counts, where))


def _view(
    tracker: ReaderStateTracker, num_rows: int | None, steps: int | None,
    ranks: Sequence[RankView], sources: tuple[SourceView, ...],
) -> ReaderView:  # fmt: skip
    """A stream node's view: its tracker's position, each rank's next share, each source."""
    return ReaderView(
        epoch=tracker.epoch,
        position=tracker.position,
        num_rows=num_rows,
        steps_remaining=steps,
        ranks=tuple(ranks),
        sources=sources,
    )
