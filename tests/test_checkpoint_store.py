"""Checkpoint I/O on a real S3 server: retried through a restart, refused credentials at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import lakeloader as ll
from tests.conftest import layout_dataset

if TYPE_CHECKING:  # imported as a plugin below: importing it here first defeats assert rewriting
    from tests.stores import ObjectStore, RestartableStore

pytest_plugins = ["tests.stores"]


def test_checkpoint_save_and_load_ride_out_a_store_restart(
    restartable_s3_store: RestartableStore, lake: Path
) -> None:
    store = restartable_s3_store
    url = store.url(f"{store.new_bucket('ckpt')}/run")
    ckpt = ll.CheckpointManager(
        url, storage_options=store.storage_options, retry=ll.RetryPolicy(deadline=90)
    )
    loader = ll.DataLoader(layout_dataset(lake), batch_size=48)
    batches = iter(loader)
    next(batches)
    ckpt.save(1, loader)
    next(batches)
    done, down, events = threading.Event(), threading.Event(), []

    def outage() -> None:
        store.stop()
        events.append(("stopped", time.monotonic()))
        down.set()
        time.sleep(5)
        store.start()
        events.append(("started", time.monotonic()))
        done.wait()  # the server dies with the thread that started it

    restarter = threading.Thread(target=outage)
    restarter.start()
    try:
        down.wait(30)
        began = time.monotonic()
        ckpt.save(2, loader)  # the store is down: retried until it is back
        saved = time.monotonic()
        assert [e for e, _ in events] == ["stopped", "started"]
        assert saved >= events[1][1] > began, "the save finished only once the store was back"
        fresh = ll.DataLoader(layout_dataset(lake), batch_size=24)
        ckpt.load(fresh)
        assert fresh.state_dict()["position"] == loader.state_dict()["position"] == 96
        assert ckpt.steps() == [1, 2]
    finally:
        done.set()
        restarter.join()
        loader.close()


def test_refused_credentials_fail_checkpoints_at_once_naming_url_and_sources(
    s3_store: ObjectStore, lake: Path
) -> None:
    url = s3_store.url(f"{s3_store.new_bucket('ckpt-creds')}/run")
    wrong = {**s3_store.storage_options, "secret": "not-the-secret"}
    ckpt = ll.CheckpointManager(url, storage_options=wrong)  # default: 5 minutes of retries
    loader = ll.DataLoader(layout_dataset(lake), batch_size=48)
    next(iter(loader))
    began = time.monotonic()
    with pytest.raises(ll.StoreAccessError) as err:
        ckpt.save(1, loader)
    assert time.monotonic() - began < 10, "a refusal is not retried"
    message = str(err.value)
    assert url.split("://")[1].split("/")[0] in message
    assert "AWS_ACCESS_KEY_ID" in message and "storage_options (key, secret" in message
    assert "not-the-secret" not in message
    with pytest.raises(ll.StoreAccessError, match="refused access"):
        ckpt.load(ll.DataLoader(layout_dataset(lake), batch_size=48))
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_read_refused_mid_run_names_the_url_and_quarantines_nothing(
    s3_store: ObjectStore, lake: Path, workers: int
) -> None:
    # Credentials that listed the lake and then stop working (rotated, expired): the pinned
    # snapshot needs no listing, so the first refusal is a data read.
    _, url = s3_store.upload(lake, f"expiring-{workers}")
    pinned = ll.LakeDataset(url, storage_options=s3_store.storage_options).snapshot
    wrong = {**s3_store.storage_options, "secret": "rotated"}
    ds = ll.LakeDataset(url, storage_options=wrong, snapshot=pinned, on_error="skip")
    loader = ll.DataLoader(ds, batch_size=48, num_workers=workers)
    began = time.monotonic()
    with pytest.raises(ll.StoreAccessError, match="refused access") as err:
        next(iter(loader))
    assert time.monotonic() - began < 20, "a refusal is not retried"
    assert url.split("://")[1].split("/")[0] in str(err.value) and "AWS_ACCESS_KEY_ID" in str(
        err.value
    )
    assert loader.state_dict()["quarantine"] in ("[]", []), "credentials are not bad data"
    loader.close()


def test_a_damaged_checkpoint_on_s3_is_named_by_its_url(s3_store: ObjectStore, lake: Path) -> None:
    url = s3_store.url(f"{s3_store.new_bucket('ckpt-damaged')}/run")
    loader = ll.DataLoader(ll.LakeDataset(lake), batch_size=8)
    with ll.CheckpointManager(url, storage_options=s3_store.storage_options) as ckpt:
        ckpt.save(1, loader)
        ckpt.save(2, loader)
        state = f"{ckpt.folders.step_folder(2)}/state.msgpack"
        ckpt.fs.pipe_file(state, b"garbage")
        with pytest.raises(ll.CheckpointError) as err:
            ckpt.read(2)
    assert str(err.value).startswith(f"{url}/step-000000000002: "), str(err.value)
