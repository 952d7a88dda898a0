"""Measure memory against shuffle breadth for the epoch order, to choose C and the window.

Everything here uses only :mod:`lakeloader.order` on synthetic layouts (no Parquet I/O): large
aligned row groups like the reference lake, small row groups, and large row groups whose last
one per file is cut short (so partition boundaries fall inside units, as in real lakes). For
each layout and each ``(C, window)`` of the grid it reports:

Memory (per rank)
    The peak number of decoded rows a rank holds. A unit at virtual position ``p`` is resident
    from the first step that gives this rank one of its rows until the step during which the
    delivered global position reaches ``release_slots(plan, [p])`` (the cache evicts it then).
    Computed exactly for every step of the epoch (interval sweep, no sampling), for
    ``world_size`` 1, 8 and 64 with ``--batch-per-rank`` rows per rank (global batch
    ``B = batch_per_rank * ws``; ``C|B`` says whether C divides it), in rows and as a multiple
    of the window, for rank 0 and the worst rank. ``pinned``: the part of the peak held by units
    that straddle a partition boundary (release waits for the end of the earlier partition, so
    such a unit stays resident until late in the epoch once touched). ``reads``: rows decoded
    by all ranks together over the epoch, per row of the epoch (ranks sharing a partition decode
    the same units).

Shuffle breadth (the global order; the same for every world size)
    For global batches of ``--metric-batch`` consecutive slots: mean distinct files, mean
    distinct row groups, and the effective number of row groups ``1 / sum(share**2)`` (the
    inverse Simpson index: if rows of a row group are alike, the variance of a batch mean scales
    as ``sum(share**2)``, so this is the number of independent row groups the batch is worth),
    also as a percentage of an ideal full row shuffle. Then the fraction of consecutive output
    rows that are adjacent in path order (``|d| == 1``) or come from the same row group or file,
    and the Spearman correlation between output slot and path-order row index over the epoch
    (dominated by the unit permutation, so it is noise of about ``1/sqrt(units)``).

Plan time
    ``make_units``, ``plan_epoch``, ``release_slots`` for every position and one step's
    ``batch_specs`` on a synthetic snapshot of 1M units.

Sampled steps of every configuration are cross-checked against ``batch_specs`` so the
vectorised simulation cannot drift from the library's own definition of a rank's rows.

Run: ``PYTHONPATH=. python benchmarks/plan_defaults.py`` (about 80 s on two cores), or
``--quick`` (a few seconds: smaller layouts and grid, no recommendation), ``--json`` for one
JSON document, ``--jobs 1`` to stay in one process.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import textwrap
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from lakeloader.order import batches as lb
from lakeloader.order import plan as lp

SEED = 1234
EPOCH = 0


@dataclass(frozen=True)
class Layout:
    """A synthetic snapshot: ``files`` x ``row_groups`` row groups of ``rows`` rows.

    With ``ragged``, the last row group of every file is cut to a seeded random 1..``rows``
    rows, as a writer leaves it, so partition boundaries fall inside units.
    """

    name: str
    files: int
    row_groups: int
    rows: int
    ragged: bool = False

    def row_group_rows(self) -> list[list[int]]:
        last = np.random.default_rng(7).integers(1, self.rows + 1, self.files)
        return [
            [self.rows] * (self.row_groups - 1) + [int(last[f]) if self.ragged else self.rows]
            for f in range(self.files)
        ]

    @property
    def num_rows(self) -> int:
        return sum(map(sum, self.row_group_rows()))

    def describe(self) -> str:
        cut = f" (last of each file cut to 1..{self.rows:,})" if self.ragged else ""
        return (
            f"{self.name}: {self.files} files x {self.row_groups} row groups x "
            f"{self.rows:,} rows{cut} = {self.num_rows:,} rows"
        )


FULL_LAYOUTS = (
    Layout("reference", 32, 4, 32_768),
    Layout("small-rg", 512, 8, 1_024),
    Layout("reference-ragged", 32, 4, 32_768, ragged=True),
)
QUICK_LAYOUTS = (
    Layout("reference/8", 32, 4, 4_096),
    Layout("small-rg/8", 64, 8, 1_024),
    Layout("ragged/8", 32, 4, 4_096, ragged=True),
)
FULL_CS = (1, 4, 8, 16, 32, 64)
FULL_WINDOWS = (1_024, 4_096, 16_384, 32_768, 65_536)
QUICK_CS = (1, 16, 64)
QUICK_WINDOWS = (1_024, 16_384)
WORLD_SIZES = (1, 8, 64)
TYPICAL_GLOBAL_BATCHES = (32, 64, 128, 256, 1024)


@dataclass
class Memory:
    world_size: int
    global_batch: int
    c_divides_batch: bool
    rank0_peak_rows: int
    rank0_peak_windows: float
    rank0_mean_rows: float
    rank0_pinned_rows: int
    worst_rank: int
    worst_peak_rows: int
    worst_peak_windows: float
    read_amplification: float


@dataclass
class Breadth:
    files_per_batch: float
    row_groups_per_batch: float
    effective_row_groups: float
    adjacent_frac: float
    same_row_group_frac: float
    same_file_frac: float
    spearman: float


@dataclass
class Result:
    layout: str
    num_partitions: int
    window: int
    breadth: Breadth
    memory: list[Memory] = field(default_factory=list)
    checked_steps: int = 0


# --------------------------------------------------------------------------------------------
# The global order, vectorised (one RNG per window, as plan.slots_to_virtual does).


def slot_virtual(plan: lp.EpochPlan) -> np.ndarray:
    """Virtual row of every global slot ``0 .. N-1``, built from ``window_permutation``."""
    n, c_count, w = plan.num_rows, plan.num_partitions, plan.window
    out = np.empty(n, dtype=np.int64)
    for c in range(c_count):
        size = int(plan.starts[c + 1] - plan.starts[c])
        if size == 0:
            continue
        pieces = [k * w + lp.window_permutation(plan, c, k) for k in range(-(-size // w))]
        out[c::c_count] = plan.starts[c] + np.concatenate(pieces)
    return out


def rank_of_slots(n: int, num_partitions: int, global_batch: int, world_size: int) -> np.ndarray:
    """Rank that receives every global slot (``batch_slots`` + ``rank_bounds``, vectorised)."""
    if world_size == 1:
        return np.zeros(n, dtype=np.int64)
    C, B = num_partitions, global_batch
    steps = -(-n // B)
    start = np.arange(steps, dtype=np.int64) * B
    stop = np.minimum(start + B, n)
    cs = np.arange(C, dtype=np.int64)
    # partition_consumed for every step boundary at once (checked against the library below).
    cons_lo = np.maximum(start[:, None] - cs + C - 1, 0) // C  # (T, C)
    cons_hi = np.maximum(stop[:, None] - cs + C - 1, 0) // C
    for t in (0, steps // 2, steps - 1):
        assert np.array_equal(cons_lo[t], lp.partition_consumed(int(start[t]), C))
        assert np.array_equal(cons_hi[t], lp.partition_consumed(int(stop[t]), C))
    counts = cons_hi - cons_lo
    # Batch position of the first slot of each partition, minus that partition's consumed count.
    shift = (np.cumsum(counts, axis=1) - counts - cons_lo).ravel()
    j = np.arange(n, dtype=np.int64)
    t = j // B
    q = shift[t * C + j % C] + j // C  # position of slot j in its batch (partition-major)
    length = stop - start
    base, extra = length // world_size, length % world_size
    cut = (extra * (base + 1))[t]
    base_t, extra_t = base[t], extra[t]
    return np.where(q < cut, q // (base_t + 1), extra_t + (q - cut) // np.maximum(base_t, 1))


def check_against_batch_specs(
    plan: lp.EpochPlan,
    virt: np.ndarray,
    ranks: np.ndarray,
    global_batch: int,
    world_size: int,
    steps: list[int],
) -> int:
    """Compare the vectorised simulation with ``batch_specs`` on a few steps; raise on mismatch."""
    n, C = plan.num_rows, plan.num_partitions
    for t in steps:
        lo, hi = t * global_batch, min((t + 1) * global_batch, n)
        for rank in sorted({0, world_size - 1}):
            (spec,) = lb.batch_specs(
                plan,
                first_step=t,
                num_steps=1,
                start=0,
                global_batch=global_batch,
                world_size=world_size,
                rank=rank,
            )
            sizes = plan.piece_rows(spec.positions)
            base = np.concatenate([[0], np.cumsum(sizes)])
            k = np.searchsorted(base, spec.take, side="right") - 1
            theirs = plan.offsets[spec.positions[k]] + spec.take - base[k]
            j = np.arange(lo, hi, dtype=np.int64)
            j = j[ranks[lo:hi] == rank]
            j = j[np.argsort(j % C, kind="stable")]
            if not np.array_equal(theirs, virt[j]):
                raise AssertionError(f"simulation differs from batch_specs at step {t} rank {rank}")
    return len(steps)


# --------------------------------------------------------------------------------------------
# Memory


def memory_for(
    plan: lp.EpochPlan,
    unit_pos: np.ndarray,
    ranks: np.ndarray,
    release: np.ndarray,
    pos_rows: np.ndarray,
    straddles: np.ndarray,
    global_batch: int,
    world_size: int,
) -> Memory:
    """Exact peak resident rows per rank over the epoch (sweep over residency intervals)."""
    n, P = plan.num_rows, len(pos_rows)
    steps = -(-n // global_batch)
    # Resident during step t iff first_step <= t and t * B < release (evicted once the
    # delivered position, t * B before step t, reaches the release slot).
    last_step = np.minimum(-(-release // global_batch) - 1, steps - 1)
    first = np.full(world_size * P, n, dtype=np.int64)
    np.minimum.at(first, ranks * P + unit_pos, np.arange(n, dtype=np.int64))
    touched = np.flatnonzero(first < n)  # (rank, unit) pairs: first slot of the unit for the rank
    rank_u, pos_u = touched // P, touched % P
    first_step = first[touched] // global_batch
    stop = np.maximum(last_step[pos_u], first_step) + 1
    peaks, means, pinned = [], [], []
    for rank in range(world_size):
        sel = rank_u == rank
        rows = pos_rows[pos_u[sel]].astype(np.float64)
        delta = np.bincount(first_step[sel], rows, minlength=steps + 1)
        delta -= np.bincount(stop[sel], rows, minlength=steps + 1)
        resident = np.cumsum(delta)[:steps]
        t_peak = int(np.argmax(resident))
        live = (first_step[sel] <= t_peak) & (stop[sel] > t_peak) & straddles[pos_u[sel]]
        peaks.append(round(resident[t_peak]))
        means.append(float(resident.mean()))
        pinned.append(round(rows[live].sum()))
    worst = int(np.argmax(peaks))
    return Memory(
        world_size=world_size,
        global_batch=global_batch,
        c_divides_batch=global_batch % plan.num_partitions == 0,
        rank0_peak_rows=peaks[0],
        rank0_peak_windows=peaks[0] / plan.window,
        rank0_mean_rows=means[0],
        rank0_pinned_rows=pinned[0],
        worst_rank=worst,
        worst_peak_rows=peaks[worst],
        worst_peak_windows=peaks[worst] / plan.window,
        read_amplification=float(pos_rows[pos_u].sum()) / n,
    )


# --------------------------------------------------------------------------------------------
# Shuffle breadth


def group_stats(keys: np.ndarray, batch: int) -> tuple[float, float]:
    """Mean distinct keys and mean inverse Simpson index over consecutive batches of keys."""
    nb = len(keys) // batch
    k = np.sort(keys[: nb * batch].reshape(nb, batch), axis=1)
    new = np.ones_like(k, dtype=bool)
    new[:, 1:] = k[:, 1:] != k[:, :-1]
    distinct = new.sum(axis=1)
    flat = np.flatnonzero(new.ravel())
    run = np.diff(np.append(flat, nb * batch))
    sumsq = np.bincount(flat // batch, run.astype(np.float64) ** 2, minlength=nb)
    return float(distinct.mean()), float(np.mean(batch * batch / sumsq))


def breadth_of(src: np.ndarray, row_file: np.ndarray, row_rg: np.ndarray, batch: int) -> Breadth:
    """Breadth metrics of an output order given as path-order row index per slot."""
    n = len(src)
    fl = row_file[src]
    rg = row_rg[src]
    files, _ = group_stats(fl, batch)
    rgs, eff = group_stats(rg, batch)
    d = src[1:] - src[:-1]
    dd = (src - np.arange(n, dtype=src.dtype)).astype(np.float64)
    rho = 1.0 - 6.0 * float(np.dot(dd, dd)) / (n * (float(n) ** 2 - 1.0))
    return Breadth(
        files_per_batch=files,
        row_groups_per_batch=rgs,
        effective_row_groups=eff,
        adjacent_frac=float(np.count_nonzero((d == 1) | (d == -1))) / (n - 1),
        same_row_group_frac=float(np.count_nonzero(rg[1:] == rg[:-1])) / (n - 1),
        same_file_frac=float(np.count_nonzero(fl[1:] == fl[:-1])) / (n - 1),
        spearman=rho,
    )


# --------------------------------------------------------------------------------------------
# One configuration


@functools.lru_cache(maxsize=1)
def make_layout(layout: Layout) -> tuple[lp.Units, np.ndarray, np.ndarray]:
    """Units of the layout, and the file and row-group id of every path-order row."""
    units = lp.make_units(layout.row_group_rows(), lp.DEFAULT_MAX_UNIT_ROWS)
    row_file = np.repeat(units.file_index, units.num_rows)
    rg_id = units.file_index * (int(units.row_group.max()) + 1) + units.row_group
    row_rg = np.repeat(rg_id, units.num_rows)
    return units, row_file, row_rg


def run_config(
    layout: Layout, C: int, W: int, batch_per_rank: int, metric_batch: int, check_steps: int
) -> Result:
    units, row_file, row_rg = make_layout(layout)
    plan = lp.plan_epoch(units, seed=SEED, epoch=EPOCH, shuffle=True, num_partitions=C, window=W)
    n = plan.num_rows
    virt = slot_virtual(plan)
    pos_rows = plan.piece_rows(np.arange(plan.num_pieces, dtype=np.int64))
    unit_pos = np.repeat(np.arange(len(pos_rows), dtype=np.int64), pos_rows)[virt]
    path_start = np.concatenate([[0], np.cumsum(units.num_rows)])[:-1]
    src = (
        path_start[plan.piece_unit[unit_pos]]
        + plan.piece_start[unit_pos]
        + (virt - plan.offsets[unit_pos])
    )
    breadth = breadth_of(src, row_file, row_rg, metric_batch)
    del src
    positions = np.arange(len(pos_rows), dtype=np.int64)
    release = lp.release_slots(plan, positions)
    first_part = np.searchsorted(plan.starts, plan.offsets[:-1], side="right") - 1
    last_part = np.searchsorted(plan.starts, plan.offsets[1:] - 1, side="right") - 1
    straddles = first_part != last_part
    result = Result(layout.name, C, W, breadth)
    for ws in WORLD_SIZES:
        gb = batch_per_rank * ws
        ranks = rank_of_slots(n, C, gb, ws)
        steps = -(-n // gb)
        sample = sorted({0, 1, steps // 3, steps // 2, steps - 1})[-check_steps:]
        result.checked_steps += check_against_batch_specs(plan, virt, ranks, gb, ws, sample)
        result.memory.append(
            memory_for(plan, unit_pos, ranks, release, pos_rows, straddles, gb, ws)
        )
    return result


def ideal(layout: Layout, metric_batch: int) -> Breadth:
    """Breadth of an ideal full row shuffle of the layout (one seeded permutation)."""
    _, row_file, row_rg = make_layout(layout)
    src = np.random.default_rng(SEED).permutation(len(row_file))
    return breadth_of(src, row_file, row_rg, metric_batch)


# --------------------------------------------------------------------------------------------
# Plan time


def plan_time(num_units: int, rows_per_unit: int, repeats: int) -> dict[str, float]:
    rg_per_file = 64
    files = num_units // rg_per_file
    rgs = [[rows_per_unit] * rg_per_file for _ in range(files)]

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    units = lp.make_units(rgs, lp.DEFAULT_MAX_UNIT_ROWS)
    C, W = lp.DEFAULT_NUM_PARTITIONS, lp.DEFAULT_WINDOW
    plan = lp.plan_epoch(units, seed=SEED, epoch=EPOCH, shuffle=True, num_partitions=C, window=W)
    positions = np.arange(len(units), dtype=np.int64)
    mid = plan.num_rows // 2 // 1024 * 1024
    return {
        "num_units": len(units),
        "num_rows": plan.num_rows,
        "make_units_s": best(lambda: lp.make_units(rgs, lp.DEFAULT_MAX_UNIT_ROWS)),
        "plan_epoch_s": best(
            lambda: lp.plan_epoch(
                units, seed=SEED, epoch=EPOCH, shuffle=True, num_partitions=C, window=W
            )
        ),
        "release_slots_all_s": best(lambda: lp.release_slots(plan, positions)),
        "batch_spec_1024_s": best(
            lambda: lb.batch_specs(
                plan, first_step=0, num_steps=1, start=mid, global_batch=1024, world_size=8, rank=0
            )
        ),
    }


# --------------------------------------------------------------------------------------------
# Report


def print_layout(layout: Layout, results: list[Result], ref: Breadth) -> None:
    n = layout.num_rows
    print()
    print("=" * 104)
    print(layout.describe())
    print("=" * 104)
    gbs = ", ".join(f"ws={m.world_size}: B={m.global_batch}" for m in results[0].memory)
    print(f"Memory: peak decoded rows resident on a rank over the epoch ({gbs})")
    print(f"{'':>16} | {'ws=1':^24} | {'ws=8':^37} | {'ws=64':^20} |")
    print(
        f"{'C':>3} {'window':>6} {'C*W/N':>5} | {'peak':>7} {'xW':>7} {'pinned':>8} | "
        f"{'rank 0':>7} {'pinned':>7} {'worst':>7} {'xW':>6} {'reads':>5} | "
        f"{'worst':>7} {'xW':>6} {'reads':>5} | {'C|B':>8}"
    )
    for r in results:
        m1, m8, m64 = r.memory
        div = "/".join("y" if m.c_divides_batch else "NO" for m in r.memory)
        print(
            f"{r.num_partitions:>3} {r.window:>6} {r.num_partitions * r.window / n:>5.2f} | "
            f"{fmt_rows(m1.rank0_peak_rows):>7} {m1.rank0_peak_windows:>7.2f} "
            f"{fmt_rows(m1.rank0_pinned_rows):>8} | "
            f"{fmt_rows(m8.rank0_peak_rows):>7} {fmt_rows(m8.rank0_pinned_rows):>7} "
            f"{fmt_rows(m8.worst_peak_rows):>7} {m8.worst_peak_windows:>6.2f} "
            f"{m8.read_amplification:>5.2f} | {fmt_rows(m64.worst_peak_rows):>7} "
            f"{m64.worst_peak_windows:>6.2f} {m64.read_amplification:>5.2f} | {div:>8}"
        )
    print()
    print(
        f"Shuffle breadth: global batches of {METRIC_BATCH[0]} rows; consecutive output rows; "
        "whole epoch"
    )
    print(
        f"{'C':>3} {'window':>6} | {'files/b':>7} {'RGs/b':>7} {'effRG/b':>7} {'eff%':>5} | "
        f"{'adjacent':>8} {'same RG':>8} {'same file':>9} | {'spearman':>9}"
    )

    def line(label: str, b: Breadth) -> str:
        return (
            f"{label} | {b.files_per_batch:>7.1f} {b.row_groups_per_batch:>7.1f} "
            f"{b.effective_row_groups:>7.1f} "
            f"{100 * b.effective_row_groups / ref.effective_row_groups:>4.0f}% | "
            f"{b.adjacent_frac:>8.4f} {b.same_row_group_frac:>8.4f} {b.same_file_frac:>9.4f} | "
            f"{b.spearman:>+9.5f}"
        )

    for r in results:
        print(line(f"{r.num_partitions:>3} {r.window:>6}", r.breadth))
    print(line(f"{'full shuffle':>10}", ref))
    print(
        "(Spearman over the epoch is dominated by the unit permutation: its noise is about "
        f"1/sqrt(units) = {1 / np.sqrt(len(make_layout(layout)[0])):.3f} here.)"
    )


#: The metric batch, set by main (printing only).
METRIC_BATCH = [1024]


def fmt_rows(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    return f"{x:,.0f}"


def print_candidates(
    layouts: tuple[Layout, ...],
    all_results: dict[str, list[Result]],
    refs: dict[str, Breadth],
    keys: list[tuple[int, int]],
) -> None:
    """One line per candidate (C, window): breadth and memory on every layout."""
    head = " | ".join(f"{lay.name[:22]:^33}" for lay in layouts)
    print(f"{'':>12} | {head}")
    cols = f"{'effRG':>6} {'eff%':>4} {'ws=1':>6} {'ws=8':>6} {'pin1':>6}"
    sub = " | ".join(cols for _ in layouts)
    print(f"{'C   window':>12} | {sub}")
    for key in keys:
        cells = []
        for lay in layouts:
            r = next(
                (x for x in all_results[lay.name] if (x.num_partitions, x.window) == key), None
            )
            if r is None:
                cells.append(f"{'-':>33}")
                continue
            m1, m8, _ = r.memory
            eff = r.breadth.effective_row_groups
            cells.append(
                f"{eff:>6.1f} {100 * eff / refs[lay.name].effective_row_groups:>3.0f}%"
                f" {fmt_rows(m1.rank0_peak_rows):>6} {fmt_rows(m8.worst_peak_rows):>6}"
                f" {fmt_rows(m1.rank0_pinned_rows):>6}"
            )
        mark = " <- current" if key == (lp.DEFAULT_NUM_PARTITIONS, lp.DEFAULT_WINDOW) else ""
        print(f"{key[0]:>3} {key[1]:>8} | " + " | ".join(cells) + mark)


class _MissingError(KeyError):
    pass


def recommendation(
    layouts: tuple[Layout, ...],
    all_results: dict[str, list[Result]],
    refs: dict[str, Breadth],
    metric_batch: int,
) -> tuple[list[str], dict[str, object]]:
    """The recommendation text, with every figure taken from the measurements.

    Expects the full layouts (large aligned row groups, small row groups, large ragged ones) and
    the full grid; anything missing yields a one-line note instead.
    """
    big, small, ragged = layouts

    def get(lay: Layout, c: int, w: int) -> Result:
        for r in all_results[lay.name]:
            if (r.num_partitions, r.window) == (c, w):
                return r
        raise _MissingError((lay.name, c, w))

    def eff(lay: Layout, c: int, w: int) -> float:
        return get(lay, c, w).breadth.effective_row_groups

    def ws1(lay: Layout, c: int, w: int) -> int:
        return get(lay, c, w).memory[0].rank0_peak_rows

    def worst(lay: Layout, c: int, w: int, i: int) -> int:
        return get(lay, c, w).memory[i].worst_peak_rows

    def reads(lay: Layout, c: int, w: int, i: int) -> float:
        return get(lay, c, w).memory[i].read_amplification

    def pct(a: float, b: float) -> str:
        return f"{100 * (a / b - 1):+.0f}%"

    C0, W0 = lp.DEFAULT_NUM_PARTITIONS, lp.DEFAULT_WINDOW
    try:
        R = ws1(small, 16, 65_536) / small.rows
        model = 1 / (1 / metric_batch + 1 / R)
        grid_cs = sorted({r.num_partitions for r in all_results[big.name]})
        ok_cs = [
            c
            for c in grid_cs
            if all(b % c == 0 for b in TYPICAL_GLOBAL_BATCHES)
            and all(reads(lay, c, W0, 1) <= 1.1 for lay in layouts)
        ]
        c_min = ok_cs[0]
        pinned = get(ragged, C0, W0).memory[0].rank0_pinned_rows
        paras = [
            "1. Breadth is bought with resident row groups, however it is split between C and W. "
            f"On {small.name}, C=16/W=65536, C=32/W=32768 and C=64/W=16384 hold "
            f"{fmt_rows(ws1(small, 16, 65_536))}/{fmt_rows(ws1(small, 32, 32_768))}/"
            f"{fmt_rows(ws1(small, 64, 16_384))} rows at ws=1 and give "
            f"{eff(small, 16, 65_536):.1f}/{eff(small, 32, 32_768):.1f}/"
            f"{eff(small, 64, 16_384):.1f} effective row groups per batch of {metric_batch}; "
            f"1/(1/B + 1/R) with R = {R:.0f} resident row groups predicts {model:.1f}. Half of "
            f"a full shuffle ({refs[small.name].effective_row_groups:.1f}) needs R ~ B = "
            f"{metric_batch} row groups resident: {fmt_rows(metric_batch * small.rows)} rows "
            f"with {small.rows:,}-row groups, {fmt_rows(metric_batch * big.rows)} with "
            f"{big.rows:,}-row groups. There is no knee to find: the defaults are a memory "
            "budget.",
            "2. A window below the row-group size costs nothing and buys nothing: on "
            f"{big.name}, C=16 holds {fmt_rows(ws1(big, 16, 1_024))} rows (ws=1) at W=1024 "
            f"and {fmt_rows(ws1(big, 16, 32_768))} at W=32768, {eff(big, 16, 1_024):.1f} vs "
            f"{eff(big, 16, 32_768):.1f} effective row groups (= C). Per rank: "
            f"~ max(1, C/ws) x max(W, unit rows); measured at ws=8, C=16/W={W0}, worst rank: "
            f"{fmt_rows(worst(small, 16, W0, 1))} rows = "
            f"{worst(small, 16, W0, 1) / W0:.2f} windows with {small.rows:,}-row groups, "
            f"{fmt_rows(worst(big, 16, W0, 1))} with {big.rows:,}-row groups.",
            "3. Units that straddle a partition boundary are cut there into pieces "
            "(plan.cut_pieces), so no piece waits for another partition: on "
            f"{ragged.name}, C={C0}/W={W0} holds {fmt_rows(ws1(ragged, C0, W0))} rows at "
            f"ws=1, of which {fmt_rows(pinned)} in boundary-pinned units; at ws=8 the worst "
            f"rank holds {fmt_rows(worst(ragged, C0, W0, 1))} vs "
            f"{fmt_rows(get(ragged, C0, W0).memory[1].rank0_peak_rows)} on rank 0.",
            "4. C below the world size multiplies reads by ws/C: at ws=8, C=1/4/8 read "
            f"{reads(small, 1, W0, 1):.2f}/{reads(small, 4, W0, 1):.2f}/"
            f"{reads(small, 8, W0, 1):.2f}x the epoch; at ws=64, C=16/32/64 read "
            f"{reads(small, 16, W0, 2):.2f}/{reads(small, 32, W0, 2):.2f}/"
            f"{reads(small, 64, W0, 2):.2f}x. At ws >= C a rank holds one window whatever C is "
            f"(ws=64 worst rank: {fmt_rows(worst(small, 16, W0, 2))} rows at C=16, "
            f"{fmt_rows(worst(small, 64, W0, 2))} at C=64).",
            "",
            f"Verdict: the measurements support DEFAULT_NUM_PARTITIONS = {C0} and "
            f"DEFAULT_WINDOW = {W0}; keep both.",
            f"- C: {c_min} is the smallest grid value that divides every typical global batch "
            f"{TYPICAL_GLOBAL_BATCHES} and reads each row once at ws=8. {C0} is one doubling "
            f"above it: reads stay 1x up to ws={C0} (reads = max(1, ws/C), point 4), and it "
            f"gives {eff(big, C0, W0):.1f} vs {eff(big, c_min, W0):.1f} effective row groups "
            f"per batch on {big.rows:,}-row groups, for {fmt_rows(worst(big, C0, W0, 1))} vs "
            f"{fmt_rows(worst(big, c_min, W0, 1))} rows per rank at ws=8. 32 doubles memory "
            f"at every W ({fmt_rows(ws1(big, 32, W0))} rows at ws=1 on {big.name}); 64 does "
            "not divide a global batch of 32.",
            f"- W: {W0} gives {eff(small, C0, W0):.1f} effective row groups "
            f"({100 * eff(small, C0, W0) / refs[small.name].effective_row_groups:.0f}% of a "
            f"full shuffle) on {small.rows:,}-row groups for {fmt_rows(ws1(small, C0, W0))} "
            f"rows at ws=1 / {fmt_rows(worst(small, C0, W0, 1))} per rank at ws=8. Doubling W "
            f"to 32768 gives {pct(eff(small, C0, 32_768), eff(small, C0, W0))} breadth for "
            f"{pct(ws1(small, C0, 32_768), ws1(small, C0, W0))} memory there, "
            f"{pct(eff(ragged, C0, 32_768), eff(ragged, C0, W0))} for "
            f"{pct(ws1(ragged, C0, 32_768), ws1(ragged, C0, W0))} on {ragged.name}, and "
            f"{pct(eff(big, C0, 32_768), eff(big, C0, W0))} for "
            f"{pct(ws1(big, C0, 32_768), ws1(big, C0, W0))} on {big.name}. Small row groups "
            "usually mean wide rows (writers size groups in bytes), where memory binds, so "
            f"the default stays at {W0}; advise window = row-group rows when groups are "
            "larger (free in memory, point 2).",
            "- Document: resident rows per rank ~ max(1, C/ws) x max(W, unit rows), plus "
            "boundary units (point 3); set C to the largest world size expected (a power of "
            "two) to keep reads at 1x when ws > C.",
        ]
        lines = []
        for para in paras:
            indent = "   " if para[:1].isdigit() else "  " if para.startswith("- ") else ""
            lines.extend(textwrap.wrap(para, 100, subsequent_indent=indent) or [""])
        doc: dict[str, object] = {
            "num_partitions": C0,
            "window": W0,
            "smallest_c_dividing_typical_batches_without_read_amplification": c_min,
            "keep_defaults": True,
        }
    except (_MissingError, IndexError) as exc:
        lines = [f"(recommendation needs the full layouts and grid; missing {exc})"]
        doc = {"missing": str(exc)}
    return lines, doc


def _worker(args: tuple[Layout, int, int, int, int, int]) -> Result:
    return run_config(*args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small layouts and grid (seconds)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead")
    ap.add_argument("--batch-per-rank", type=int, default=32, help="rows per rank per step")
    ap.add_argument("--metric-batch", type=int, default=1024, help="global batch for breadth")
    ap.add_argument("--partitions", type=int, nargs="+", help="values of C (overrides the grid)")
    ap.add_argument("--windows", type=int, nargs="+", help="windows (overrides the grid)")
    ap.add_argument("--plan-units", type=int, default=None, help="units for the plan timing")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    args = ap.parse_args(argv)
    METRIC_BATCH[0] = args.metric_batch

    layouts = QUICK_LAYOUTS if args.quick else FULL_LAYOUTS
    cs = tuple(args.partitions or (QUICK_CS if args.quick else FULL_CS))
    windows = tuple(args.windows or (QUICK_WINDOWS if args.quick else FULL_WINDOWS))
    plan_units = args.plan_units or (65_536 if args.quick else 1_048_576)
    t_start = time.perf_counter()

    tasks = [
        (lay, C, W, args.batch_per_rank, args.metric_batch, 4)
        for lay in layouts
        for C in cs
        for W in windows
    ]
    if args.jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(args.jobs) as pool:
            flat = pool.map(_worker, tasks, chunksize=1)
    else:
        flat = [_worker(t) for t in tasks]
    all_results = {lay.name: [r for r in flat if r.layout == lay.name] for lay in layouts}
    refs = {lay.name: ideal(lay, args.metric_batch) for lay in layouts}
    timing = plan_time(plan_units, 4_096, repeats=3)
    rec_lines, rec_doc = recommendation(layouts, all_results, refs, args.metric_batch)
    elapsed = time.perf_counter() - t_start

    if args.json:
        doc = {
            "seed": SEED,
            "epoch": EPOCH,
            "batch_per_rank": args.batch_per_rank,
            "metric_batch": args.metric_batch,
            "world_sizes": list(WORLD_SIZES),
            "layouts": [
                asdict(lay) | {"num_rows": lay.num_rows, "description": lay.describe()}
                for lay in layouts
            ],
            "ideal": {k: asdict(v) for k, v in refs.items()},
            "results": [asdict(r) for r in flat],
            "plan_time": timing,
            "recommendation": rec_doc | {"text": rec_lines},
            "defaults": {"num_partitions": lp.DEFAULT_NUM_PARTITIONS, "window": lp.DEFAULT_WINDOW},
            "elapsed_s": elapsed,
        }
        print(json.dumps(doc, indent=1))
        return 0

    print(
        f"lakeloader.order.plan order: memory vs shuffle breadth (seed {SEED}, epoch {EPOCH}, "
        f"{args.batch_per_rank} rows per rank per step)"
    )
    for lay in layouts:
        print_layout(lay, all_results[lay.name], refs[lay.name])

    print()
    print("=" * 104)
    print(
        f"Plan time, {timing['num_units']:,} units ({timing['num_rows']:,} rows), "
        f"C={lp.DEFAULT_NUM_PARTITIONS}, window={lp.DEFAULT_WINDOW} (best of 3):"
    )
    for label, key in (
        ("make_units (from per-file row-group sizes)", "make_units_s"),
        ("plan_epoch", "plan_epoch_s"),
        ("release_slots for every position", "release_slots_all_s"),
        ("batch_specs, one 1024-row global batch, ws=8", "batch_spec_1024_s"),
    ):
        print(f"  {label:<46} {timing[key] * 1e3:8.1f} ms")

    print()
    print("=" * 104)
    print(
        "Candidates (effRG = effective row groups per global batch of "
        f"{args.metric_batch}; ws=1 = peak rows, ws=8 = worst rank's peak rows;"
    )
    print(" pin1 = rows of the ws=1 peak held by units that straddle a partition boundary)")
    keys = sorted(
        {(r.num_partitions, r.window) for r in flat}
        & {(c, w) for c in (8, 16, 32) for w in (16_384, 32_768, 65_536)}
    )
    print_candidates(layouts, all_results, refs, keys)
    checked = sum(r.checked_steps for r in flat)
    print()
    print("=" * 104)
    print("Recommendation")
    for text in rec_lines:
        print(text)
    print()
    print(f"({checked} sampled steps cross-checked against batch_specs; {elapsed:.1f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
