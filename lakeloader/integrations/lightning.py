"""PyTorch Lightning with lakeloader: what the plain loader does, and what the callback adds.

The plain loader, with no adapter (tested with Lightning 2.6.6, strategies ``ddp`` and
``ddp_spawn`` on 2 processes, a SIGKILL and a resume with ``ckpt_path``):

- ``trainer.fit(model, train_dataloaders=ll.DataLoader(ds, batch_size=64))``, the loader made
  anywhere: at the script's top level (``ddp`` runs the script again in every process;
  ``ddp_spawn`` pickles the loader into them), in ``train_dataloader()`` or a DataModule. Rank
  and world size are resolved when a pass starts, inside ``fit()``.
- Epochs: Lightning calls ``loader.sampler.set_epoch(current_epoch)``, which reaches the loader
  (also for a loader made anew by ``reload_dataloaders_every_n_epochs``).
- A mid-epoch checkpoint (``ModelCheckpoint(every_n_train_steps=k)``) resumes exactly on the
  same number of processes: Lightning saves ``loader.state_dict()`` in
  ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` and loads it. An
  end-of-epoch checkpoint resumes at the next epoch (see 2. below).
- Validation: ``ll.DataLoader(val_ds, batch_size=..., restart_on_iter=True)``, so that every
  ``iter()`` (one per validation run) is a whole pass: the sanity check
  (``num_sanity_val_steps``) and ``limit_val_batches=k`` take the first batches and eat none
  of the next validation's; under ``ddp`` each rank validates its share. Without
  ``restart_on_iter`` a new ``iter()`` continues the pass under way, and Lightning's
  ``set_epoch`` starts it again only when the training epoch changes: the validation after a
  sanity check of 2 batches sees only the batches after those 2, and validations within one
  training epoch (``val_check_interval`` < 1) with ``limit_val_batches=k`` take successive
  windows of ``k`` batches, not the first ``k``.

:class:`LakeloaderCallback` adds what the plain loader cannot know:

1. Lightning fetches one batch ahead of the step for a loader without ``len()``
   (``follow=``, ``endless=True``): the state it saves counts a batch no step trained on, and
   a resume would skip it. The callback saves the state as it stood before that batch.
2. An end-of-epoch checkpoint (``ModelCheckpoint``'s default) is resumed by Lightning without
   the loader's state. A loader with ``len()`` needs nothing: Lightning's ``set_epoch(e + 1)``
   comes after its ``iter()`` but before the first batch, where the pass begins, so it runs
   epoch ``e + 1``. A followed lake, whose epochs are not Lightning's, would read its first
   increment again: the callback restores the saved state (it goes on from the increment it
   was in).
3. ``self.trainer.estimated_stepping_batches`` in ``configure_optimizers`` sets the loaders
   up before Lightning restores its loops, and it then restores no loader state (Lightning's
   issue 20550): the resume would start the epoch again. The callback restores them.
4. A resume on another number of processes or batch size: Lightning's progress counters
   (``batch_progress``) count the epoch's steps of the old topology and ``len(loader)`` those of
   the new. Every row still comes once, but Lightning's ``batch_idx`` is off, and the epoch
   ends on a batch Lightning does not know as its last (the loader's ``StopIteration``): no
   validation at that epoch's end, no epoch-interval scheduler step. The callback recounts
   the steps done in the new topology (for a single training loader over a ``LakeDataset``).

It uses Lightning's private ``Trainer.fit_loop._data_fetcher``, ``._combined_loader`` and
``._combined_loader_states_to_load``; a Lightning without them raises
:class:`LightningVersionError`.

Lightning calls ``loader.sampler.set_epoch(current_epoch)`` on loaders without ``len()``
too, which ignore it: their epochs are not Lightning's. An endless loader stays in Lightning's
epoch 0 (stop the run with ``max_steps``); a followed lake's Lightning epoch ends each time
the loader catches up (``Follow(timeout=...)``), and the next goes on with what was appended.

Example::

    loader = ll.DataLoader(ll.LakeDataset("s3://bucket/lake", seed=0), batch_size=64)
    trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[
        ModelCheckpoint(every_n_train_steps=500, save_last=True), LakeloaderCallback()])
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

import lightning.pytorch as pl

from lakeloader.errors import LakeError
from lakeloader.loader import DataLoader

logger = logging.getLogger(__name__)

#: The Lightning version whose private attributes the callback is tested against.
TESTED_VERSION = "2.6.6"


class LightningVersionError(LakeError, RuntimeError):
    """The installed Lightning keeps something the callback relies on elsewhere."""


def _moved(what: str) -> LightningVersionError:
    return LightningVersionError(
        f"{what} is missing in Lightning {version('lightning')} (LakeloaderCallback is tested with "
        f"{TESTED_VERSION}): install lightning=={TESTED_VERSION}, or leave the callback out "
        "(a mid-epoch checkpoint of a loader with len() resumes without it)"
    )


def _private(owner: object, name: str, where: str) -> Any:
    """``owner.name``, or a :class:`LightningVersionError` naming it and the versions."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _moved(f"{where}.{name}") from None


def _stateful(loader: object) -> bool:
    """Whether Lightning saves this loader's state (its ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The training loaders whose states Lightning saves, in the order it saves them."""
    combined = _private(trainer.fit_loop, "_combined_loader", "Trainer.fit_loop")
    if combined is None:
        return []
    return [loader for loader in combined.flattened if _stateful(loader)]


def fetched_ahead(trainer: pl.Trainer) -> int:
    """Batches Lightning's training fetcher holds that no step has trained on yet.

    Lightning prefetches one batch from a loader without ``len()`` (its
    ``_PrefetchDataFetcher``); none from a loader with one, nor for a ``training_step`` that
    takes ``dataloader_iter``.
    """
    fetcher = _private(trainer.fit_loop, "_data_fetcher", "Trainer.fit_loop")
    try:
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    except ImportError:
        raise _moved("lightning.pytorch.loops.fetchers._PrefetchDataFetcher") from None
    if not isinstance(fetcher, _PrefetchDataFetcher):
        return 0
    return len(_private(fetcher, "batches", "_PrefetchDataFetcher"))


def steps_done(loader: DataLoader) -> int | None:
    """Steps of the loader's epoch done, in its topology now (None: it cannot tell).

    ``len(loader)`` less the steps left, so that a position saved under another number of
    processes or batch size counts in this one's steps. A loader without ``len()`` cannot
    tell.
    """
    try:
        return len(loader) - loader.steps_left()
    except TypeError:
        return None


class LakeloaderCallback(pl.Callback):
    """Exact resumes of lakeloader loaders from Lightning's checkpoints (module docstring).

    Add it to the ``Trainer``'s callbacks beside the ``ModelCheckpoint``; it takes no
    argument and finds the training loaders in the trainer. Other loaders pass untouched;
    Lightning's steps are recounted for a single training loader over a ``LakeDataset``.
    """

    def __init__(self) -> None:
        self._saved: list[Any] | None = None  # the states of a checkpoint being resumed

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save each lake loader's state as it stood before the batches fetched ahead.

        Raises:
            LightningVersionError: If Lightning keeps the loaders' states elsewhere.
            LakeError: If a loader cannot stand before a batch fetched ahead (a mixture or
                packed stream without ``len()``), naming the way out.
        """
        loaders = train_loaders(trainer)
        lakes = [i for i, loader in enumerate(loaders) if isinstance(loader, DataLoader)]
        if not lakes or "loops" not in checkpoint:  # no loader of ours, or weights only
            return
        where = "checkpoint['loops']['fit_loop']['state_dict']['combined_loader']"
        try:
            states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        except KeyError:
            raise _moved(where) from None
        if len(states) != len(loaders):
            raise _moved(f"one state per loader ({len(loaders)}, not {len(states)}) in {where}")
        ahead = fetched_ahead(trainer)
        for i in lakes:
            try:
                states[i] = loaders[i].state_dict(fetched_ahead=ahead)
            except ValueError as err:
                raise LakeError(
                    f"cannot save the training loader's state in {where}: Lightning fetched "
                    f"{ahead} batch ahead of the step it checkpoints (a loader without len()), "
                    f"and {err}; a training_step(self, dataloader_iter) fetches none ahead"
                ) from err

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep the loaders' states of a checkpoint that ``fit`` resumes."""
        if trainer.state.fn == "fit":
            fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            self._saved = fit.get("combined_loader")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a mid-epoch checkpoint, count the epoch's steps done in this topology.

        Lightning restored the loaders' states from a mid-epoch checkpoint, unless it set its
        loaders up before it restored its loops (``estimated_stepping_batches`` in
        ``configure_optimizers``, Lightning's issue 20550): the callback restores them then.
        From an end-of-epoch checkpoint it restores none, and :meth:`on_train_epoch_start`
        does.
        """
        if not trainer.fit_loop.restarting:
            return
        saved, self._saved = self._saved, None
        fit = trainer.fit_loop
        if saved is not None and _private(fit, "_combined_loader_states_to_load", "fit_loop"):
            _restore(trainer, saved)  # Lightning left them
        loaders = train_loaders(trainer)
        if _private(fit, "restarted_mid_epoch", "Trainer.fit_loop") and (
            len(loaders) == 1 and isinstance(loaders[0], DataLoader)
        ):
            _recount(trainer, loaders[0])

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After an end-of-epoch checkpoint, restore the loaders' states."""
        saved, self._saved = self._saved, None
        if saved is not None:
            _restore(trainer, saved)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Forget a checkpoint's states that no epoch took."""
        self._saved = None


def _restore(trainer: pl.Trainer, saved: list[Any]) -> None:
    """Load the lake loaders' states of a checkpoint, and begin Lightning's pass again.

    Lightning began a pass on each loader as it stood before (as made, or made again by
    ``reload_dataloaders_every_n_epochs``), which a load (or its ``set_epoch``) ended.
    """
    loaders = train_loaders(trainer)
    lakes = [i for i, loader in enumerate(loaders) if isinstance(loader, DataLoader)]
    if not lakes or len(saved) != len(loaders):
        return
    for i in lakes:
        loaders[i].load_state_dict(saved[i])
        if _sized(loaders[i]):
            loaders[i].set_epoch(trainer.current_epoch)  # as Lightning has done or will do
    iter(_private(trainer.fit_loop, "_data_fetcher", "Trainer.fit_loop"))
    logger.info("the checkpoint's loader states restored, which Lightning did not restore")


def _sized(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _recount(trainer: pl.Trainer, loader: DataLoader) -> None:
    """Make Lightning's batch counts of the epoch under way the loader's steps done."""
    done = steps_done(loader)
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    if done is None or done == progress.ready:
        return
    logger.info(
        "Lightning's batches fetched in the epoch under way: %d, counted in %s as %d",
        progress.ready,
        loader.topology.describe(),
        done,
    )
    progress.increment_by(done - progress.ready)  # ready, started, processed and completed
