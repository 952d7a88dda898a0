"""The library's use without surprises: columns, errors, pickling, ``with``, views, globs."""

from __future__ import annotations

from pathlib import Path

import pytest

import lakeloader as ll
from tests.conftest import write_lake

# ------------------------------------------------------------------------------------ columns


def test_a_single_column_name_is_one_column(lake: Path) -> None:
    ds = ll.LakeDataset(lake, columns="id", shuffle=False)
    assert ds.config.columns == ("id",)
    batch = next(iter(ll.DataLoader(ds, batch_size=4)))
    assert set(batch) == {"id"} and batch["id"].tolist() == [0, 1, 2, 3]


def test_a_wrong_column_is_a_lake_error_in_one_line_with_the_closest_first(lake: Path) -> None:
    with pytest.raises(ll.ColumnNotFoundError) as err:
        ll.LakeDataset(lake, columns=["id", "lable"])
    assert isinstance(err.value, ll.LakeError) and isinstance(err.value, KeyError)
    message = str(err.value)
    assert message == err.value.args[0], "no quoted repr, as a bare KeyError gives"
    assert "\n" not in message
    assert message.startswith(f"column 'lable' is not in the lake {lake} (did you mean 'label'?)")
    assert "its columns, closest first: 'label', " in message
    assert all(repr(c) in message for c in ("id", "x", "s", "label"))
    assert "Pass columns=" in message


def test_several_wrong_columns_are_named_together(tmp_path: Path) -> None:
    write_lake(tmp_path, [[3]], hive=True)
    with pytest.raises(KeyError, match=r"columns 'nope', 'prat' are not in the lake") as err:
        ll.LakeDataset(tmp_path, columns=["nope", "prat"])
    assert "did you mean 'part'?" in str(err.value)
