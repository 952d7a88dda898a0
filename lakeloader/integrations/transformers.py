"""``LakeTrainer``: a ``transformers.Trainer`` that trains on a lake, every row once per epoch.

Pass a :class:`~lakeloader.LakeDataset` or a :class:`~lakeloader.Mixture` as
``train_dataset`` (and a ``LakeDataset`` as ``eval_dataset``) to ``LakeTrainer`` instead of
``Trainer``; everything else is the Trainer's: its arguments, checkpoints and
``train(resume_from_checkpoint=...)``. What it changes:

- The loaders are :class:`lakeloader.DataLoader` s with the Trainer's arguments:
  ``per_device_train_batch_size`` (``per_device_eval_batch_size``), ``dataloader_drop_last``,
  ``dataloader_num_workers``, ``dataloader_prefetch_factor``,
  ``dataloader_persistent_workers``, ``dataloader_multiprocessing_context``, and
  ``dataloader_pin_memory`` where there is an accelerator. Batches are dicts of tensors, one
  per column the dataset selects (``LakeDataset(columns=...)``; ``remove_unused_columns`` does
  not apply to them). A ``data_collator`` passed explicitly becomes the loader's
  ``collate_fn`` (it receives the rows of a batch as dicts, columns the model does not take
  removed as the Trainer does); the Trainer's default collator is not used. An evaluation
  loader makes every evaluation a whole pass (``restart_on_iter=True``); with several
  processes, a short last batch may differ by a row between ranks, so logits and labels that
  are gathered across ranks need padding (the loss alone is fine).
- Every checkpoint folder gets ``lakeloader_state.json``, the loader's position (global: the
  same on every rank), written by the process that writes ``trainer_state.json``. A resume
  loads it before any batch is read, so the Trainer skips no batch: its skip
  (accelerate's ``skip_first_batches``) is bypassed for this loader while the epoch runs.
- After a resume, the Trainer's counters are derived from the loader's position under the
  current number of processes: the epoch, the batches done in it, and ``global_step``
  (steps of the current global batch; ``max_steps`` counts them too). A resume on another
  number of processes thus ends where an uninterrupted run on that many ends, and the
  learning-rate schedule is moved by as many steps as ``global_step``. Checkpoints are
  numbered by the new steps: after a resume on more processes the new numbers are smaller
  than the old run's (and may be the same folders), and ``resume_from_checkpoint=True`` takes
  the highest number, so clear the old run's checkpoints or resume by path. With
  ``ignore_data_skip=True`` the loader resumes at its position all the same (that costs
  nothing), and the Trainer's counters stay right.

Private ``Trainer`` methods are overridden (transformers 5.24.0 is the version tested);
making a ``LakeTrainer`` with a transformers that lacks one raises
:class:`TrainerVersionError`. Units a rank quarantines (``on_error="skip"``) are not merged
into the saved state: only the saving process's are kept.

Example (two processes: ``torchrun --nproc-per-node=2 train.py``)::

    trainer = LakeTrainer(model=model, args=TrainingArguments(...),
                          train_dataset=ll.LakeDataset("s3://bucket/lake", seed=0))
    trainer.train(resume_from_checkpoint=resume)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard, cast

import torch
import transformers
import transformers.trainer as hf_trainer
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lakeloader.dataset import LakeDataset
from lakeloader.errors import LakeError
from lakeloader.loader import DataLoader
from lakeloader.mixture import Mixture

logger = logging.getLogger(__name__)

#: The file each checkpoint folder holds the loader's position in.
STATE_NAME = "lakeloader_state.json"
#: The transformers version LakeTrainer was written against and tested with.
TESTED_VERSION = "5.24.0"
#: The Trainer methods LakeTrainer overrides or calls, with the parameters it relies on.
TRAINER_METHODS: dict[str, tuple[str, ...]] = {
    "_init_training_state": (
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
    "_run_epoch": ("epoch", "resume_from_checkpoint", "steps_trained_in_current_epoch"),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_get_collator_with_removed_columns": ("data_collator", "description"),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
}


class TrainerVersionError(LakeError, RuntimeError):
    """The installed transformers lacks a ``Trainer`` method that ``LakeTrainer`` needs."""


class LakeTrainerError(LakeError, ValueError):
    """A dataset ``LakeTrainer`` cannot train on, or a checkpoint it cannot resume from."""


def check_trainer(trainer_class: type = Trainer) -> None:
    """Check that ``trainer_class`` has the methods and parameters ``LakeTrainer`` relies on.

    Raises:
        TrainerVersionError: Naming the method, the installed transformers version and the
            tested one.
    """
    where = f"transformers {transformers.__version__} (LakeTrainer is tested with {TESTED_VERSION})"
    fix = f"install transformers=={TESTED_VERSION}"
    for name, wanted in TRAINER_METHODS.items():
        method = getattr(trainer_class, name, None)
        if not callable(method):
            raise TrainerVersionError(f"Trainer.{name} is missing in {where}: {fix}")
        params = inspect.signature(method).parameters
        missing = [p for p in wanted if p not in params]
        if missing:
            raise TrainerVersionError(
                f"Trainer.{name} of {where} takes {list(params)}, not {missing}: {fix}"
            )
    if not callable(getattr(hf_trainer, _SKIP, None)):
        raise TrainerVersionError(
            f"transformers.trainer.skip_first_batches is missing in {where}: {fix}"
        )


# ------------------------------------------------------------ the Trainer's skip, bypassed
#: The name, in ``transformers.trainer``, of the function that skips a resumed epoch's batches.
_SKIP = "skip_first_batches"
#: Loaders whose position a LakeTrainer restored, while their epoch runs.
_positioned: weakref.WeakSet[DataLoader] = weakref.WeakSet()
_patch_lock = threading.Lock()
_patch_users = 0
_original_skip: Callable[..., Any] | None = None


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """The original ``skip_first_batches``, except for a loader standing at its position."""
    if dataloader in _positioned:
        return dataloader  # the restored position is past those batches already
    assert _original_skip is not None
    return _original_skip(dataloader, num_batches)


@contextlib.contextmanager
def _no_skip_for(loader: DataLoader) -> Iterator[None]:
    """Make ``transformers.trainer.skip_first_batches`` return ``loader`` as it is, meanwhile.

    The module attribute is replaced while any LakeTrainer runs an epoch (a count, so that
    trainers in several threads share one replacement) and put back after the last; other
    loaders go to the original.
    """
    global _patch_users, _original_skip
    with _patch_lock:
        if _patch_users == 0:
            _original_skip = getattr(hf_trainer, _SKIP)
            setattr(hf_trainer, _SKIP, _skip_first_batches)
        _patch_users += 1
        _positioned.add(loader)
    try:
        yield
    finally:
        with _patch_lock:
            _positioned.discard(loader)
            _patch_users -= 1
            if _patch_users == 0:
                if getattr(hf_trainer, _SKIP) is _skip_first_batches:
                    setattr(hf_trainer, _SKIP, _original_skip)
                else:  # replaced again meanwhile, by someone else: theirs stays
                    logger.warning(
                        "transformers.trainer.skip_first_batches was replaced while a "
                        "LakeTrainer ran an epoch: left as it is now"
                    )
                _original_skip = None


# -------------------------------------------------------------------------- the trainer
def _is_lake(dataset: object) -> TypeGuard[LakeDataset | Mixture]:
    return isinstance(dataset, (LakeDataset, Mixture))


def epoch_and_steps_done(loader: DataLoader) -> tuple[int, int]:
    """The epoch a loader's position is in and the steps of it done, for this topology.

    The steps done are ``len(loader)`` less the steps left, so that a position saved under
    another number of processes or batch size counts in this one's steps. A position whose
    rows left make no step (``drop_last``) stands at the start of the next epoch.
    """
    left = loader.steps_left()
    if left == 0:
        return loader.epoch + 1, 0
    return loader.epoch, len(loader) - left


class LakeTrainer(Trainer):
    """A ``transformers.Trainer`` over a lake (see the module docstring).

    Takes the Trainer's arguments; ``train_dataset`` a :class:`~lakeloader.LakeDataset` or
    :class:`~lakeloader.Mixture`, ``eval_dataset`` a ``LakeDataset`` (or a dict of them).
    Other datasets are the Trainer's as usual.

    Raises:
        TrainerVersionError: If the installed transformers lacks a method it overrides.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_trainer()
        if transformers.__version__ != TESTED_VERSION:
            logger.warning(
                "LakeTrainer is tested with transformers %s, not %s: it overrides private "
                "Trainer methods",
                TESTED_VERSION,
                transformers.__version__,
            )
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)
        #: The collator the user passed (None: the loader's own batches).
        self.lake_collator: Callable[[list[dict[str, Any]]], Any] | None = bound.arguments.get(
            "data_collator"
        )
        #: The training loader of the current ``train()`` (None: not a lake).
        self.lake_loader: DataLoader | None = None
        self._lake_step_shift = 0
        self._lake_short_group = 0
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------- loaders
    def _lake_loader(
        self, dataset: LakeDataset | Mixture, batch_size: int, **kw: Any
    ) -> DataLoader:
        endless = "follow" if getattr(dataset, "follow", None) else "packed"
        if endless == "follow" or dataset.packing is not None:
            raise LakeTrainerError(
                f"LakeTrainer cannot train on a {endless} dataset (an endless "
                "stream has no epochs for the Trainer to count): pass a LakeDataset without "
                "follow= or packing=, or a Mixture without packing"
            )
        args = self.args
        collate = self.lake_collator
        if collate is not None:
            collate = self._get_collator_with_removed_columns(collate, description="lake")
        return DataLoader(
            dataset,
            batch_size=batch_size,
            drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers,
            collate_fn=collate,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            prefetch_factor=args.dataloader_prefetch_factor,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            **kw,
        )

    def get_train_dataloader(self) -> Any:
        """A :class:`lakeloader.DataLoader` over a lake ``train_dataset`` (else the Trainer's)."""
        if not _is_lake(self.train_dataset):
            self.lake_loader = None
            return super().get_train_dataloader()
        self.lake_loader = self._lake_loader(self.train_dataset, self._train_batch_size)
        return self.lake_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """A whole pass over a lake evaluation dataset at every evaluation (else the Trainer's)."""
        dataset = eval_dataset
        if isinstance(eval_dataset, str):
            dataset = cast(dict[str, Any], self.eval_dataset)[eval_dataset]
        elif eval_dataset is None:
            dataset = self.eval_dataset
        return self._eval_loader(
            dataset, lambda: super(LakeTrainer, self).get_eval_dataloader(eval_dataset)
        )

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """A whole pass over a lake test dataset (else the Trainer's)."""
        return self._eval_loader(
            test_dataset, lambda: super(LakeTrainer, self).get_test_dataloader(test_dataset)
        )

    def _eval_loader(self, dataset: Any, otherwise: Callable[[], Any]) -> Any:
        if not _is_lake(dataset):
            return otherwise()
        if isinstance(dataset, Mixture):
            raise LakeTrainerError(
                "LakeTrainer evaluates on a LakeDataset, not a Mixture (a mixture streams on "
                "and cannot make every evaluation the same pass): pass one of its sources"
            )
        return self._lake_loader(dataset, self.args.eval_batch_size, restart_on_iter=True)

    # ----------------------------------------------------------------- save and resume
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write the loader's position into the checkpoint folder, then the Trainer's files."""
        loader = self.lake_loader
        if loader is not None and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial),
                f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
            )
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, STATE_NAME)
            with open(f"{path}.tmp", "w", encoding="utf-8") as out:
                json.dump(loader.state_dict(), out)
            os.replace(f"{path}.tmp", path)
        super()._save_checkpoint(model, trial)

    def _init_training_state(
        self,
        max_steps: Any,
        num_update_steps_per_epoch: Any,
        num_train_epochs: Any,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's state, then the loader's position and the counters derived from it.

        Raises:
            LakeTrainerError: If the checkpoint folder holds no loader state.
        """
        counters: tuple[int, int] = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        loader, self._lake_step_shift, self._lake_short_group = self.lake_loader, 0, 0
        if loader is None or resume_from_checkpoint is None:
            return counters
        path = os.path.join(resume_from_checkpoint, STATE_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            raise LakeTrainerError(
                f"no {STATE_NAME} in checkpoint {resume_from_checkpoint}: it was not saved by a "
                "LakeTrainer, or its save was cut short; resume from a folder that has one"
            ) from None
        loader.load_state_dict(state)
        epoch, done = epoch_and_steps_done(loader)
        ga = self.args.gradient_accumulation_steps
        step = epoch * num_update_steps_per_epoch + done // ga
        # Batches done in the middle of an accumulation group (a position saved under fewer
        # processes): the rest of that group is the first one.
        self._lake_short_group = -done % ga
        if step != self.state.global_step:
            logger.info(
                "resumed at global step %d of the checkpoint's topology, step %d of this one "
                "(epoch %d, %d of its %d batches done on %d processes)",
                self.state.global_step,
                step,
                epoch,
                done,
                len(loader),
                loader.world_size,
            )
        self._lake_step_shift = step - self.state.global_step
        self.state.global_step = step
        self.state.epoch = epoch + done / len(loader)
        return epoch, done

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's, then the schedule moved as far as ``global_step`` was."""
        super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = self.lr_scheduler
        if self._lake_step_shift and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            scheduler.last_epoch += self._lake_step_shift

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: Any, device: Any
    ) -> tuple[list[Any], Any]:
        """The Trainer's, the first group after a resume cut to where the group ends.

        A resume whose batches done end inside a gradient-accumulation group (a position
        saved under another number of processes) takes the rest of that group alone, so
        that every later group is the uninterrupted run's: the Trainer synchronises the
        processes' gradients at the last batch of each group it takes, and steps the
        optimizer where the uninterrupted run's groups end.
        """
        if self._lake_short_group:
            num_batches, self._lake_short_group = min(num_batches, self._lake_short_group), 0
        samples: tuple[list[Any], Any] = super().get_batch_samples(
            epoch_iterator, num_batches, device
        )
        return samples

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's epoch, skipping nothing: the loader resumes at its position.

        The Trainer's counters of a resumed epoch are kept (its micro-step, hence the last,
        short gradient-accumulation group), with or without ``ignore_data_skip``.
        """
        loader, run_epoch = self.lake_loader, cast(Callable[..., Any], super()._run_epoch)
        if loader is None:
            return run_epoch(*args, **kwargs)
        ignore = self.args.ignore_data_skip
        self.args.ignore_data_skip = False
        try:
            with _no_skip_for(loader):
                return run_epoch(*args, **kwargs)
        finally:
            self.args.ignore_data_skip = ignore
