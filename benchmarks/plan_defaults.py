"""Measure memory against shuffle breadth for the epoch order, to choose C and the window.

Everything here uses only :mod:`lakeloader.plan` on synthetic layouts (no Parquet I/O). For each
layout and each ``(C, window)`` of the grid it reports:

Memory (per rank)
    The peak number of decoded rows a rank holds. A unit at virtual position ``p`` is resident
    from the first step that gives this rank one of its rows until the step during which the
    delivered global position reaches ``release_slots(plan, [p])`` (the cache evicts it then).
    This is computed exactly for every step of the epoch (interval sweep, no sampling). Given
    for ``world_size=1`` and for ``world_size=8`` (rank 0 and the worst rank), in rows and as a
    multiple of the window. ``pinned`` is the part of the peak due to units that straddle a
    partition boundary: release waits for the end of the earlier partition, so such a unit stays
    resident until almost the end of the epoch once a rank has touched it.

Shuffle breadth (the global order; the same for every world size)
    For global batches of ``--metric-batch`` consecutive slots: mean distinct files, mean
    distinct row groups, and the effective number of row groups ``1 / sum(share**2)`` (the
    inverse Simpson index: if rows of a row group are alike, the variance of a batch mean scales
    as ``sum(share**2)``, so this is the number of independent row groups the batch is worth).
    Then the fraction of consecutive output rows that are adjacent in path order (``|d| == 1``)
    or come from the same row group, and the Spearman correlation between output slot and
    path-order row index over the epoch. An ideal full row shuffle is given for reference.

Plan time
    ``make_units``, ``plan_epoch``, ``release_slots`` for every position and one ``batch_spec``
    on a synthetic snapshot of 1M units.

A few steps of every configuration are cross-checked against ``batch_spec`` so the vectorised
simulation cannot drift from the library's own definition of a rank's rows.

Run: ``PYTHONPATH=. python benchmarks/plan_defaults.py`` (about a minute and a half), or
``--quick`` (a few seconds, smaller layouts and grid), ``--json`` for machine output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from lakeloader import plan as lp

SEED = 1234
EPOCH = 0


@dataclass(frozen=True)
class Layout:
    name: str
    files: int
    row_groups: int
    rows: int

    @property
    def num_rows(self) -> int:
        return self.files * self.row_groups * self.rows

    def describe(self) -> str:
        return (
            f"{self.name}: {self.files} files x {self.row_groups} row groups x "
            f"{self.rows:,} rows = {self.num_rows:,} rows"
        )


FULL_LAYOUTS = (
    Layout("reference", 32, 4, 32_768),
    Layout("small-rg", 512, 8, 1_024),
)
QUICK_LAYOUTS = (
    Layout("reference/8", 32, 4, 4_096),
    Layout("small-rg/8", 64, 8, 1_024),
)
FULL_CS = (1, 4, 8, 16, 32, 64)
FULL_WINDOWS = (1_024, 4_096, 16_384, 65_536)
QUICK_CS = (1, 16, 64)
QUICK_WINDOWS = (1_024, 16_384)
WORLD_SIZES = (1, 8)


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
    C, B = num_partitions, global_batch
    steps = -(-n // B)
    start = np.arange(steps, dtype=np.int64) * B
    stop = np.minimum(start + B, n)
    cons_lo = np.stack([lp.partition_consumed(int(s), C) for s in start])  # (T, C)
    cons_hi = np.stack([lp.partition_consumed(int(s), C) for s in stop])
    counts = cons_hi - cons_lo
    before = np.cumsum(counts, axis=1) - counts  # batch positions before partition c
    j = np.arange(n, dtype=np.int64)
    t, c = j // B, j % C
    q = before[t, c] + (j // C - cons_lo[t, c])  # position of slot j in its batch
    length = (stop - start)[t]
    base, extra = length // world_size, length % world_size
    cut = extra * (base + 1)
    return np.where(q < cut, q // (base + 1), extra + (q - cut) // np.maximum(base, 1))


def check_against_batch_spec(
    plan: lp.EpochPlan,
    virt: np.ndarray,
    ranks: np.ndarray,
    global_batch: int,
    world_size: int,
    steps: list[int],
) -> int:
    """Compare the vectorised simulation with ``batch_spec`` on a few steps; raise on mismatch."""
    n, C = plan.num_rows, plan.num_partitions
    for t in steps:
        lo, hi = t * global_batch, min((t + 1) * global_batch, n)
        for rank in sorted({0, world_size - 1}):
            spec = lp.batch_spec(plan, t, lo, hi, world_size, rank)
            sizes = plan.units.num_rows[plan.order[spec.positions]]
            base = np.concatenate([[0], np.cumsum(sizes)])
            k = np.searchsorted(base, spec.take, side="right") - 1
            theirs = plan.offsets[spec.positions[k]] + spec.take - base[k]
            j = np.arange(lo, hi, dtype=np.int64)
            j = j[ranks[lo:hi] == rank]
            j = j[np.argsort(j % C, kind="stable")]
            if not np.array_equal(theirs, virt[j]):
                raise AssertionError(f"simulation differs from batch_spec at step {t} rank {rank}")
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
    # Resident during step t iff first_step <= t and t * B < release.
    last_step = np.minimum(-(-release // global_batch) - 1, steps - 1)
    key = ranks * P + unit_pos
    uniq, first = np.unique(key, return_index=True)  # first slot of each (rank, unit)
    rank_u, pos_u = uniq // P, uniq % P
    first_step = first // global_batch
    stop = np.maximum(last_step[pos_u], first_step) + 1
    peaks, means, pinned = [], [], []
    for rank in range(world_size):
        sel = rank_u == rank
        rows = pos_rows[pos_u[sel]]
        delta = np.bincount(first_step[sel], rows, minlength=steps + 1)
        delta -= np.bincount(stop[sel], rows, minlength=steps + 1)
        resident = np.cumsum(delta)[:steps]
        t_peak = int(np.argmax(resident))
        live = (first_step[sel] <= t_peak) & (stop[sel] > t_peak) & straddles[pos_u[sel]]
        peaks.append(int(resident[t_peak]))
        means.append(float(resident.mean()))
        pinned.append(int(rows[live].sum()))
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
    files, _ = group_stats(row_file[src], batch)
    rgs, eff = group_stats(row_rg[src], batch)
    d = np.diff(src)
    rg = row_rg[src]
    fl = row_file[src]
    dd = (src - np.arange(n)).astype(np.float64)
    rho = 1.0 - 6.0 * float(np.dot(dd, dd)) / (n * (float(n) ** 2 - 1.0))
    return Breadth(
        files_per_batch=files,
        row_groups_per_batch=rgs,
        effective_row_groups=eff,
        adjacent_frac=float(np.mean(np.abs(d) == 1)),
        same_row_group_frac=float(np.mean(rg[1:] == rg[:-1])),
        same_file_frac=float(np.mean(fl[1:] == fl[:-1])),
        spearman=rho,
    )


# --------------------------------------------------------------------------------------------
# One configuration


def run_config(
    layout: Layout,
    units: lp.Units,
    row_file: np.ndarray,
    row_rg: np.ndarray,
    C: int,
    W: int,
    batch_per_rank: int,
    metric_batch: int,
    check_steps: int,
) -> Result:
    plan = lp.plan_epoch(units, seed=SEED, epoch=EPOCH, shuffle=True, num_partitions=C, window=W)
    n = plan.num_rows
    virt = slot_virtual(plan)
    pos_rows = units.num_rows[plan.order]
    unit_pos = np.repeat(np.arange(len(pos_rows), dtype=np.int64), pos_rows)[virt]
    path_start = np.concatenate([[0], np.cumsum(units.num_rows)])[:-1]
    src = path_start[plan.order[unit_pos]] + (virt - plan.offsets[unit_pos])
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
        result.checked_steps += check_against_batch_spec(plan, virt, ranks, gb, ws, sample)
        result.memory.append(
            memory_for(plan, unit_pos, ranks, release, pos_rows, straddles, gb, ws)
        )
    return result


def ideal(units: lp.Units, row_file: np.ndarray, row_rg: np.ndarray, metric_batch: int) -> Breadth:
    n = int(units.num_rows.sum())
    src = lp._rng(SEED, EPOCH, 99).permutation(n)
    return breadth_of(src, row_file, row_rg, metric_batch)


def make_layout(layout: Layout) -> tuple[lp.Units, np.ndarray, np.ndarray]:
    rgs = [[layout.rows] * layout.row_groups for _ in range(layout.files)]
    units = lp.make_units(rgs, lp.DEFAULT_MAX_UNIT_ROWS)
    row_file = np.repeat(units.file_index, units.num_rows)
    rg_id = units.file_index * (int(units.row_group.max()) + 1) + units.row_group
    row_rg = np.repeat(rg_id, units.num_rows)
    return units, row_file, row_rg


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
        "batch_spec_1024_s": best(lambda: lp.batch_spec(plan, 0, mid, mid + 1024, 8, 0)),
    }


# --------------------------------------------------------------------------------------------
# Report


def fmt_rows(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    return f"{x:,.0f}"


def print_layout(layout: Layout, results: list[Result], ref: Breadth, batch_per_rank: int) -> None:
    print()
    print("=" * 100)
    print(layout.describe())
    print("=" * 100)
    gbs = ", ".join(f"ws={ws}: B={batch_per_rank * ws}" for ws in WORLD_SIZES)
    print(f"Memory: peak decoded rows resident on a rank over the epoch ({gbs})")
    print(
        f"{'C':>3} {'window':>7} {'C*W/N':>6} | "
        f"{'ws=1 peak':>9} {'xW':>6} {'pinned':>7} | "
        f"{'ws=8 r0 peak':>12} {'xW':>6} {'mean':>6} {'pinned':>7} | "
        f"{'worst':>5} {'peak':>7} {'xW':>6} | {'C|B':>4}"
    )
    for r in results:
        m1, m8 = r.memory
        div = "yes" if m1.c_divides_batch and m8.c_divides_batch else "NO"
        print(
            f"{r.num_partitions:>3} {r.window:>7} {r.num_partitions * r.window / layout.num_rows:>6.3f} | "
            f"{fmt_rows(m1.rank0_peak_rows):>9} {m1.rank0_peak_windows:>6.2f} "
            f"{fmt_rows(m1.rank0_pinned_rows):>7} | "
            f"{fmt_rows(m8.rank0_peak_rows):>12} {m8.rank0_peak_windows:>6.2f} "
            f"{fmt_rows(m8.rank0_mean_rows):>6} {fmt_rows(m8.rank0_pinned_rows):>7} | "
            f"{'r' + str(m8.worst_rank):>5} {fmt_rows(m8.worst_peak_rows):>7} "
            f"{m8.worst_peak_windows:>6.2f} | {div:>4}"
        )
    print()
    print("Shuffle breadth: per global batch of the metric size; consecutive output rows; epoch")
    print(
        f"{'C':>3} {'window':>7} | {'files/b':>7} {'RGs/b':>7} {'effRG/b':>7} {'eff%':>5} | "
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
        print(line(f"{r.num_partitions:>3} {r.window:>7}", r.breadth))
    print(line(f"{'ideal full shuffle':>11}", ref))


def recommend(
    layouts: tuple[Layout, ...],
    all_results: dict[str, list[Result]],
    refs: dict[str, Breadth],
    target: float,
) -> dict[str, object]:
    """Smallest (C, window) whose breadth reaches ``target`` of the best in the grid, per layout.

    Breadth is the effective row groups per batch, as a fraction of the best the grid reaches on
    that layout (the ideal full shuffle is not reachable by design when a layout has few row
    groups); the pick minimises the worst rank's peak memory at ``world_size=8`` among the
    configurations that qualify, preferring the smaller C on ties.
    """
    picks = {}
    for layout in layouts:
        res = all_results[layout.name]
        best = max(r.breadth.effective_row_groups for r in res)
        ok = [r for r in res if r.breadth.effective_row_groups >= target * best]
        pick = min(ok, key=lambda r: (r.memory[1].worst_peak_rows, r.num_partitions, r.window))
        picks[layout.name] = {
            "num_partitions": pick.num_partitions,
            "window": pick.window,
            "effective_row_groups": pick.breadth.effective_row_groups,
            "best_in_grid": best,
            "ideal": refs[layout.name].effective_row_groups,
            "ws8_worst_peak_rows": pick.memory[1].worst_peak_rows,
            "ws1_peak_rows": pick.memory[0].rank0_peak_rows,
        }
    return picks


def summary_row(r: Result, ref: Breadth) -> str:
    m1, m8 = r.memory
    return (
        f"C={r.num_partitions:<3} W={r.window:<6} effRG/b={r.breadth.effective_row_groups:6.1f} "
        f"({100 * r.breadth.effective_row_groups / ref.effective_row_groups:3.0f}% of ideal), "
        f"RGs/b={r.breadth.row_groups_per_batch:6.1f}, files/b={r.breadth.files_per_batch:5.1f}; "
        f"peak ws=1 {fmt_rows(m1.rank0_peak_rows)} rows, ws=8 worst rank "
        f"{fmt_rows(m8.worst_peak_rows)} rows ({m8.worst_peak_windows:.1f} windows)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small layouts and grid (seconds)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead")
    ap.add_argument("--batch-per-rank", type=int, default=64, help="rows per rank per step")
    ap.add_argument("--metric-batch", type=int, default=1024, help="global batch for breadth")
    ap.add_argument("--plan-units", type=int, default=None, help="units for the plan timing")
    ap.add_argument(
        "--target", type=float, default=0.5, help="breadth fraction of the grid's best to aim at"
    )
    args = ap.parse_args(argv)

    layouts = QUICK_LAYOUTS if args.quick else FULL_LAYOUTS
    cs = QUICK_CS if args.quick else FULL_CS
    windows = QUICK_WINDOWS if args.quick else FULL_WINDOWS
    plan_units = args.plan_units or (65_536 if args.quick else 1_048_576)
    t_start = time.perf_counter()

    all_results: dict[str, list[Result]] = {}
    refs: dict[str, Breadth] = {}
    for layout in layouts:
        units, row_file, row_rg = make_layout(layout)
        refs[layout.name] = ideal(units, row_file, row_rg, args.metric_batch)
        all_results[layout.name] = [
            run_config(
                layout, units, row_file, row_rg, C, W, args.batch_per_rank, args.metric_batch, 4
            )
            for C in cs
            for W in windows
        ]
        if not args.json:
            print_layout(layout, all_results[layout.name], refs[layout.name], args.batch_per_rank)
            sys.stdout.flush()

    timing = plan_time(plan_units, 4_096, repeats=3)
    picks = recommend(layouts, all_results, refs, args.target)
    elapsed = time.perf_counter() - t_start

    if args.json:
        doc = {
            "seed": SEED,
            "epoch": EPOCH,
            "batch_per_rank": args.batch_per_rank,
            "metric_batch": args.metric_batch,
            "world_sizes": list(WORLD_SIZES),
            "layouts": [asdict(layout) | {"num_rows": layout.num_rows} for layout in layouts],
            "ideal": {k: asdict(v) for k, v in refs.items()},
            "results": [asdict(r) for res in all_results.values() for r in res],
            "plan_time": timing,
            "recommendation": picks,
            "defaults": {"num_partitions": lp.DEFAULT_NUM_PARTITIONS, "window": lp.DEFAULT_WINDOW},
            "elapsed_s": elapsed,
        }
        print(json.dumps(doc, indent=1))
        return 0

    print()
    print("=" * 100)
    print(
        f"Plan time, {timing['num_units']:,} units ({timing['num_rows']:,} rows), "
        f"C={lp.DEFAULT_NUM_PARTITIONS}, window={lp.DEFAULT_WINDOW} (best of 3):"
    )
    print(f"  make_units (from per-file row-group sizes)  {timing['make_units_s'] * 1e3:8.1f} ms")
    print(f"  plan_epoch                                  {timing['plan_epoch_s'] * 1e3:8.1f} ms")
    print(
        f"  release_slots for every position            "
        f"{timing['release_slots_all_s'] * 1e3:8.1f} ms"
    )
    print(
        f"  batch_spec, 1024-row batch, ws=8            {timing['batch_spec_1024_s'] * 1e3:8.1f} ms"
    )

    print()
    print("=" * 100)
    print(
        f"Recommendation input: cheapest (ws=8 worst-rank peak) config reaching "
        f"{args.target:.0%} of the grid's best effective row groups per batch"
    )
    for layout in layouts:
        p = picks[layout.name]
        print(f"  {layout.name}: C={p['num_partitions']}, window={p['window']}")
    print("Current defaults and neighbours:")
    for layout in layouts:
        res = {(r.num_partitions, r.window): r for r in all_results[layout.name]}
        print(f"  {layout.name}:")
        for key in sorted(res):
            if key in {
                (lp.DEFAULT_NUM_PARTITIONS, lp.DEFAULT_WINDOW),
                (lp.DEFAULT_NUM_PARTITIONS, 4_096),
                (lp.DEFAULT_NUM_PARTITIONS // 2, lp.DEFAULT_WINDOW),
                (lp.DEFAULT_NUM_PARTITIONS * 2, lp.DEFAULT_WINDOW),
                (lp.DEFAULT_NUM_PARTITIONS * 2, 4_096),
                (lp.DEFAULT_NUM_PARTITIONS, 65_536),
            }:
                print("    " + summary_row(res[key], refs[layout.name]))
    checked = sum(r.checked_steps for res in all_results.values() for r in res)
    print(f"({checked} sampled steps cross-checked against batch_spec; {elapsed:.1f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
