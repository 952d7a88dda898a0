"""``LakeTrainer`` (lakeloader.integrations.transformers) with the real ``transformers.Trainer``.

The runs (tests/transformers_child.py: 1000 rows, batch 8 per process, gradient accumulation
2, a checkpoint every 5 optimizer steps, 2 epochs), on gloo over loopback:

- ``A``: 2 processes, rank 0 SIGKILLed after step 13 (epoch 0; checkpoint 10 is the last);
- ``B``: ``resume_from_checkpoint=True`` on 2 processes with ``ignore_data_skip=True``,
  SIGKILLed after step 47 (epoch 1; checkpoint 45);
- ``C``: ``resume_from_checkpoint=True`` on 1 process, to the end;
- ``R2``, ``R1``: uninterrupted runs on 2 and 1 processes, each followed by the plain Trainer
  over a torch dataset of the same rows for one epoch (its optimizer steps per epoch);
- ``D``: checkpoint 15 of ``R1`` resumed on 2 processes, to the end (15 batches of 2 ranks
  done: an odd number, so its first optimizer step takes one batch instead of two).

Each rank logs the ids of every optimizer step with the Trainer's global step and epoch; what
an attempt did past the checkpoint the next one resumed from was replayed and is dropped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lakeloader as ll
from tests.conftest import TORCHRUN_ENV, torchrun_command, write_lake

pytestmark = pytest.mark.slow  # torchrun runs of the real Trainer: not in the quick tier

transformers = pytest.importorskip("transformers")
import transformers.trainer as hf_trainer  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from lakeloader.integrations import transformers as lt  # noqa: E402
from tests.transformers_child import training_args  # noqa: E402

CHILD = Path(__file__).with_name("transformers_child.py")
LAYOUT = [[300, 200], [250], [150, 100]]
ROWS = 1000
BATCH, GA, EPOCHS = 8, 2, 2
#: Optimizer steps per epoch on 1 and 2 processes: ceil(ceil(1000 / (8 n)) / 2).
STEPS = {n: math.ceil(math.ceil(ROWS / (BATCH * n)) / GA) for n in (1, 2)}
KILL_A, KILL_B = 13, 47
RUN_TIMEOUT = 150.0


@dataclass
class Launch:
    """One launch of the child and what its ranks logged."""

    name: str
    returncode: int
    seconds: float
    output: Path
    records: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    def resumed_from(self) -> int:
        """The number of the checkpoint every rank took."""
        (name,) = {r["checkpoint"] for r in self.of("resume")}
        return int(name.rsplit("-", 1)[1])

    def by_step(self, weights: bool = True) -> dict[int, dict[str, Any]]:
        """Per global step: the Trainer's epoch, the learning rate, the weights after the step
        (unless ``weights`` is False), which every rank must have alike, and all ranks' ids.
        """
        out: dict[int, dict[str, Any]] = {}
        for r in self.of("step"):
            same = {"epoch": r["epoch"], "lr": r["lr"], "weights": r["weights"]}
            got = out.setdefault(r["step"], {**same, "ids": set()})
            assert {**got, "ids": None} == {**same, "ids": None}, f"{self.name} rank {r['rank']}"
            got["ids"] |= set(r["ids"])
        return {
            s: {**got, "weights": got["weights"] if weights else None} for s, got in out.items()
        }

    def finished(self) -> Launch:
        tail = self.output.read_text(errors="replace")[-4000:]
        assert self.returncode == 0 and self.of("end"), f"{self.name}: {self.returncode}\n{tail}"
        return self

    def killed(self, step: int) -> Launch:
        assert self.returncode != 0 and not self.of("end"), f"{self.name} was not killed"
        assert max(r["step"] for r in self.of("step")) == step
        return self


def launch(work: Path, name: str, nproc: int, out: str, *options: str) -> Launch:
    """Run the child on ``nproc`` processes (torchrun for 2), output in ``work/name.out``."""
    log = work / name
    child = [str(work / "lake"), str(work / out), str(log), "--ga", str(GA), *options]
    if nproc > 1:
        cmd = torchrun_command(nproc, CHILD, *child)
    else:
        cmd = [sys.executable, str(CHILD), *child]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCHRUN_ENV)
    output = work / f"{name}.out"
    start = time.monotonic()
    with output.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its ranks
            try:
                returncode = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
        finally:
            records = _records(work, name)
            _kill_leftovers([r["pid"] for r in records if r["type"] == "start"])
    return Launch(name, returncode, time.monotonic() - start, output, records)


def _records(work: Path, name: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(work.glob(f"{name}-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        with path.open(encoding="utf-8") as lines:
            records += [{**json.loads(line), "rank": rank} for line in lines]
    return records


def _kill_leftovers(pids: list[int]) -> None:
    """SIGKILL ranks of a launch that outlived it."""
    for pid in pids:
        try:
            if CHILD.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("transformers")
    assert write_lake(root / "lake", LAYOUT) == ROWS
    return root


@pytest.fixture(scope="module")
def crashes(work: Path) -> list[Launch]:
    """A, B and C (see the module docstring)."""
    a = launch(work, "A", 2, "out", "--kill-at", str(KILL_A)).killed(KILL_A)
    b = launch(work, "B", 2, "out", "--resume", "--ignore-data-skip", "--kill-at", str(KILL_B))
    c = launch(work, "C", 1, "out", "--resume").finished()
    return [a, b.killed(KILL_B), c]


@pytest.fixture(scope="module")
def references(work: Path) -> dict[int, Launch]:
    """R1 and R2, uninterrupted, with the plain Trainer's steps per epoch."""
    return {n: launch(work, f"R{n}", n, f"ref{n}", "--torch-reference").finished() for n in (1, 2)}


def tally(segments: list[Launch], until: float = math.inf) -> list[tuple[int, int, int]]:
    """Per epoch: rows trained, ids missing, ids doubled, in the steps that count.

    An attempt's steps past the checkpoint the next one resumed from were replayed: they do
    not count (nor do the last one's past ``until``). Every step's epoch as the Trainer counts
    it must be the loader's.
    """
    kept: list[dict[str, Any]] = []
    for i, run in enumerate(segments):
        limit = segments[i + 1].resumed_from() if i + 1 < len(segments) else until
        kept += [r for r in run.of("step") if r["step"] <= limit]
    wrong = [r for r in kept if math.ceil(r["epoch"]) - 1 != r["loader_epoch"]]
    assert not wrong, f"the Trainer's epoch is not the loader's: {wrong[:3]}"
    figures = []
    for epoch in range(EPOCHS):
        ids = Counter(i for r in kept if r["loader_epoch"] == epoch for i in r["ids"])
        figures.append((sum(ids.values()), ROWS - len(ids), sum(n > 1 for n in ids.values())))
    return figures


def said(figures: list[tuple[int, int, int]]) -> str:
    return "; ".join(
        f"epoch {e}: {t} rows trained, {m} missing, {d} doubled"
        for e, (t, m, d) in enumerate(figures)
    )


def test_a_sigkill_a_resume_on_2_processes_another_and_one_on_1_train_every_row_once(
    crashes: list[Launch],
) -> None:
    a, b, c = crashes
    assert (b.resumed_from(), c.resumed_from()) == (10, 45)
    # Checkpoint 45 of 2 processes: 26 of the 63 batches of 16 rows of epoch 1 are done.
    on_two = tally([a, b], until=45)
    everything = tally(crashes)
    print(
        f"\n2 processes, SIGKILL after step {KILL_A}, resumed from checkpoint 10 on 2 "
        f"(ignore_data_skip), SIGKILL after step {KILL_B}: up to checkpoint 45 {said(on_two)}"
        f"\nresumed from checkpoint 45 on 1 process to the end: {said(everything)}"
        f"\n({a.seconds:.0f} + {b.seconds:.0f} + {c.seconds:.0f} s)"
    )
    assert on_two == [(ROWS, 0, 0), (26 * 16, ROWS - 26 * 16, 0)], said(on_two)
    assert everything == [(ROWS, 0, 0)] * EPOCHS, said(everything)


def test_the_counters_after_each_resume_are_an_uninterrupted_runs(
    crashes: list[Launch], references: dict[int, Launch]
) -> None:
    _, b, c = crashes
    # Checkpoint 45 of 2 processes stands 26 batches of 2 x 8 rows into epoch 1: 52 batches
    # of 8 on 1 process, 26 optimizer steps into its epoch 1.
    on_one = STEPS[1] + 2 * (45 - STEPS[2])
    # On as many processes as the checkpoint's, the weights are the uninterrupted run's too.
    for run, n, start in ((b, 2, 10), (c, 1, on_one)):
        ref = references[n].by_step(weights=run is b)
        assert {r["step"] for r in run.of("begin")} == {start}, run.name
        assert {r["epoch"] for r in run.of("begin")} == {ref[start]["epoch"]}, run.name
        got = run.by_step(weights=run is b)
        assert min(got) == start + 1, run.name
        for step, seen in got.items():
            assert seen == ref[step], f"{run.name} step {step}: not as in R{n}"
    (end,) = {(r["step"], r["epoch"]) for r in c.of("end")}
    (expected,) = {(r["step"], r["epoch"]) for r in references[1].of("end")}
    assert end == expected == (EPOCHS * STEPS[1], float(EPOCHS))
    print(
        f"\nB from step 10 (2 processes) and C from step {on_one} (checkpoint 45 of 2 "
        "processes, on 1) trained the rows, epoch and learning rate of the uninterrupted runs "
        f"at every step (B to the same weights); C ended at global_step {end[0]}, "
        f"epoch {end[1]}, as R1 did"
    )


def test_a_resume_of_a_1_process_run_on_2_ends_as_an_uninterrupted_2_process_run(
    work: Path, references: dict[int, Launch]
) -> None:
    (work / "d-out").mkdir()
    shutil.copytree(work / "ref1" / "checkpoint-15", work / "d-out" / "checkpoint-15")
    d = launch(work, "D", 2, "d-out", "--resume").finished()
    assert d.resumed_from() == 15
    # 15 steps of 2 x 8 rows on 1 process are 15 batches of 2 x 8 on 2: 7 steps and a batch.
    assert {r["step"] for r in d.of("begin")} == {7}
    figures = tally([references[1], d])
    ref, got = references[2].by_step(weights=False), d.by_step(weights=False)
    assert min(got) == 8 and got[8]["ids"] < ref[8]["ids"]  # the batch done is not repeated
    assert {**got[8], "ids": None} == {**ref[8], "ids": None}
    assert all(seen == ref[step] for step, seen in got.items() if step > 8)
    ends = [{(r["step"], r["epoch"]) for r in run.of("end")} for run in (d, references[2])]
    assert ends[0] == ends[1] == {(EPOCHS * STEPS[2], float(EPOCHS))}
    print(f"\n1 process to checkpoint 15, resumed on 2: {said(figures)}; ended as R2 did")
    assert figures == [(ROWS, 0, 0)] * EPOCHS, said(figures)


def test_optimizer_steps_per_epoch_equal_the_plain_trainers_over_torchs_loader(
    references: dict[int, Launch],
) -> None:
    for n, run in references.items():
        (torch_steps,) = {r["steps_per_epoch"] for r in run.of("torch")}
        (end,) = {r["step"] for r in run.of("end")}
        assert end == EPOCHS * torch_steps == EPOCHS * STEPS[n], (n, end, torch_steps)
    print(f"\noptimizer steps per epoch, gradient accumulation {GA}: {STEPS}, as torch's loader")


# ------------------------------------------------------------------- in this process


class Net(torch.nn.Module):
    """One weight; keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(self, id: torch.Tensor, x: torch.Tensor, **rest: Any) -> dict[str, Any]:
        key = rest.get("source", torch.zeros_like(id))
        self.seen.append([int(s) * 10_000 + int(i) for s, i in zip(key, id, strict=True)])
        return {"loss": ((self.linear(x[:, None] / 500) - 1) ** 2).mean()}


def args(out: Path, **kw: Any) -> TrainingArguments:
    return training_args(str(out), **{"save_strategy": "no", "epochs": 1, **kw})


@pytest.fixture(scope="module")
def small(work: Path) -> ll.LakeDataset:
    return ll.LakeDataset(str(work / "lake"), seed=5, columns=["id", "x"])


def test_a_mixture_resumes_where_it_stood(work: Path, tmp_path: Path) -> None:
    sources = {
        n: ll.LakeDataset(str(work / "lake"), seed=s, columns=["id", "x"])
        for n, s in (("a", 1), ("b", 2))
    }
    mix = ll.Mixture(sources, {"a": 3, "b": 1}, epoch_rows=300)
    whole = Net()
    LakeTrainer = lt.LakeTrainer
    LakeTrainer(model=whole, args=args(tmp_path / "w", epochs=2), train_dataset=mix).train()
    first = Net()
    part = args(tmp_path / "p", epochs=2, max_steps=50, save_strategy="steps", save_steps=50)
    LakeTrainer(model=first, args=part, train_dataset=mix).train()
    rest = Net()
    resumed = LakeTrainer(model=rest, args=args(tmp_path / "p", epochs=2), train_dataset=mix)
    resumed.train(resume_from_checkpoint=str(tmp_path / "p" / "checkpoint-50"))
    assert len(whole.seen) == 2 * math.ceil(300 / BATCH) == resumed.state.global_step
    assert first.seen + rest.seen == whole.seen


def test_every_evaluation_is_a_whole_pass_and_a_given_collator_gets_the_rows(
    small: ll.LakeDataset, work: Path, tmp_path: Path
) -> None:
    net, got = Net(), []

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        got.append(sorted(rows[0]))
        return {k: torch.tensor([r[k] for r in rows]) for k in ("id", "x")}

    with_s = ll.LakeDataset(str(work / "lake"), seed=5, columns=["id", "x", "s"])
    trainer = lt.LakeTrainer(
        model=net,
        args=args(tmp_path, remove_unused_columns=True, max_steps=3),
        train_dataset=with_s,
        eval_dataset=small,
        data_collator=collate,
    )
    trainer.train()
    assert got == [["id", "x"]] * 3  # the column the model does not take was removed
    for _ in range(2):
        net.seen.clear()
        trainer.evaluate()
        assert sorted(i for b in net.seen for i in b) == list(range(ROWS))


def test_a_checkpoint_without_the_loaders_state_is_refused(
    small: ll.LakeDataset, tmp_path: Path
) -> None:
    a = args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    lt.LakeTrainer(model=Net(), args=a, train_dataset=small).train()
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / lt.STATE_NAME).unlink()
    with pytest.raises(lt.LakeTrainerError, match=f"no {lt.STATE_NAME} in checkpoint {checkpoint}"):
        lt.LakeTrainer(model=Net(), args=args(tmp_path), train_dataset=small).train(
            resume_from_checkpoint=str(checkpoint)
        )


def test_a_trainer_without_a_method_it_needs_is_named_with_the_version() -> None:
    class Renamed(Trainer):
        _run_epoch = None

    class Changed(Trainer):
        def _save_checkpoint(self, model: Any) -> None:  # type: ignore[override]
            pass

    version = transformers.__version__
    with pytest.raises(
        lt.TrainerVersionError, match=rf"Trainer._run_epoch is missing in transformers {version}"
    ):
        lt.check_trainer(Renamed)
    with pytest.raises(lt.TrainerVersionError, match=r"_save_checkpoint .* not \['trial'\]"):
        lt.check_trainer(Changed)
    lt.check_trainer()


def test_the_skip_is_bypassed_for_the_positioned_loaders_only_and_put_back(
    small: ll.LakeDataset,
) -> None:
    original = hf_trainer.skip_first_batches
    mine, theirs = ll.DataLoader(small, batch_size=BATCH), ll.DataLoader(small, batch_size=BATCH)
    plain = torch.utils.data.DataLoader(range(10), batch_size=2)
    inside = threading.Event()
    leave = threading.Event()

    def other_trainer() -> None:  # another trainer's epoch, in another thread
        with lt._no_skip_for(theirs):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_trainer)
    thread.start()
    inside.wait(10)
    with lt._no_skip_for(mine):
        assert hf_trainer.skip_first_batches(mine, 3) is mine
        assert hf_trainer.skip_first_batches(theirs, 3) is theirs
        assert [b.tolist() for b in hf_trainer.skip_first_batches(plain, 3)] == [[6, 7], [8, 9]]
    assert hf_trainer.skip_first_batches is not original  # the other epoch still runs
    with pytest.raises((AttributeError, TypeError, ValueError)):  # accelerate's cannot skip it
        hf_trainer.skip_first_batches(mine, 3)
    leave.set()
    thread.join()
    assert hf_trainer.skip_first_batches is original


def test_an_endless_stream_is_refused_saying_what_to_pass(work: Path, tmp_path: Path) -> None:
    followed = ll.LakeDataset(str(work / "lake"), columns=["id", "x"], follow=ll.Follow())
    trainer = lt.LakeTrainer(model=Net(), args=args(tmp_path, max_steps=1), train_dataset=followed)
    with pytest.raises(
        lt.LakeTrainerError, match=r"a follow dataset .* without follow= or packing="
    ):
        trainer.train()
