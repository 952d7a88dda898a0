"""Building batches ahead in a background thread of the loader's process (no workers).

With ``num_workers=0`` and a ``batch_transform``, the batches and their transform run in one
thread of the loader's process (:class:`ThreadBuilder`), up to ``prefetch_factor`` steps ahead
of delivery, so that the training loop's own work overlaps theirs; a vectorised transform
releases the GIL in its kernels. Batches are still delivered strictly in step order, and a
step's error is raised when that step is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lakeloader.order.batches import BatchSpec
from lakeloader.pipeline.builders import LocalBuilder, timed_out
from lakeloader.pipeline.recipe import Payload
from lakeloader.pipeline.workspace import PassSpec
from lakeloader.signals import main_thread_only


class ThreadBuilder:
    """Has one background thread build the next steps with a :class:`LocalBuilder`.

    Args:
        spec: The pass.
        local: Builds a step (in the thread).
        planned: The step of a given index, once planned (None before).
    """

    def __init__(
        self, spec: PassSpec, local: LocalBuilder, planned: Callable[[int], BatchSpec | None]
    ) -> None:
        self._spec = spec
        self._local = local
        self._planned = planned
        self._ahead = max(1, spec.options.prefetch_factor)
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="lakeloader-build", initializer=main_thread_only
        )
        self._futures: dict[int, Future[Payload]] = {}
        self._next = 0  # the next step to hand to the thread

    def build(self, step: BatchSpec) -> Payload:
        """The payload of ``step``, once the thread has built it; the next steps are queued.

        Raises:
            RuntimeError: If it takes longer than the loader's ``timeout``.
        """
        self._next = max(self._next, step.step)
        while self._next <= step.step + self._ahead:
            planned = self._planned(self._next)
            if planned is None:
                break
            self._futures[planned.step] = self._thread.submit(self._local.build, planned)
            self._next += 1
        future = self._futures.pop(step.step, None)
        if future is None:  # not planned when the thread was topped up
            future = self._thread.submit(self._local.build, step)
        try:
            return future.result(self._spec.options.timeout or None)
        except FutureTimeout:
            raise timed_out(self._spec, step.step) from None

    def close(self, wait: bool) -> None:
        """Cancel the steps queued; wait for the one under way if ``wait``."""
        self._thread.shutdown(wait=wait, cancel_futures=True)
