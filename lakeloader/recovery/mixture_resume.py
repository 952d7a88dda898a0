"""A saved mixture state onto the mixture of now (a pure function; the loader applies it)."""

from __future__ import annotations

from dataclasses import replace

from lakeloader.errors import StateMismatchError
from lakeloader.mixture import Mixture
from lakeloader.order.mixture import MixWeights
from lakeloader.state.mixture_state import MixtureState, SourceRecord, WeightChange


def resume_mixture(
    saved: MixtureState,
    mixture: Mixture,
    now: dict[str, SourceRecord],
    moved: frozenset[str],
) -> tuple[MixtureState, tuple[str, ...]]:
    """Map ``saved`` onto ``mixture``.

    ``now``: what each source is as the state would record it (a followed lake's: the
    increment the saved record names, found again).
    ``moved``: the sources whose lake changed since a checkpoint, which the recovery
    coordinator mapped onto the lake of now (``RecoveryCoordinator.resume_source``).

    Returns:
        The state to continue from (sources, counts and history of the mixture now), and
        what differs from the saved mixture, in words (logged by the loader).

    Raises:
        StateMismatchError: If the mixture's seed differs, or a source present in both reads
            another snapshot or order configuration than the one saved (both named).
    """
    if saved.seed != mixture.seed:
        raise StateMismatchError(
            f"the state's mixture seed is {saved.seed}, this Mixture's is {mixture.seed}: the "
            f"interleaving would change. Build the Mixture with seed={saved.seed}"
        )
    for name in sorted((set(now) & set(saved.sources)) - moved):
        was, cur = saved.sources[name], now[name]
        if not saved.counts.get(name, 0) and was.increment is None:  # an older first state
            was = replace(was, increment=cur.increment)  # named no followed lake's increment
        if not was.same_source(cur):
            raise StateMismatchError(
                f"mixture source {name!r} is not the one saved: saved snapshot {was.fingerprint} "
                f"(config {was.config}, {was.rows} rows, increment {was.increment}), now "
                f"{cur.fingerprint} (config {cur.config}, {cur.rows} rows, increment "
                f"{cur.increment}). Resume with the same snapshot and order settings for this "
                "source, or give it another name to start it afresh"
            )
    changes = [
        f"source {n!r} added (starts at its first row)"
        for n in sorted(set(now) - set(saved.sources))
    ]
    changes += [
        f"source {n!r} removed (its count {saved.counts.get(n, 0)} is kept)"
        for n in sorted(set(saved.sources) - set(now))
    ]
    history = saved.history
    last = MixWeights.of(history[-1].weights) if history else None
    if last != mixture.weights:
        history = (*history, WeightChange(saved.slot, dict(mixture.raw_weights)))
        changes.append(f"weights {mixture.raw_weights} from slot {saved.slot}")
    counts = {**{n: 0 for n in now}, **saved.counts}
    state = replace(
        saved, counts=counts, history=history, sources=now, epoch_rows=mixture.epoch_rows
    )
    return state, tuple(changes)
