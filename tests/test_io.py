"""The one Parquet writer: declared schema, provenance, atomic replacement, clear errors."""

from __future__ import annotations

import os

import polars as pl
import pyarrow as pa
import pytest

from stages.core.common import io

SCHEMA = pa.schema([pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.list_(pa.int32()))])
PROV = {"stage": "t", "stage_version": "1", "config_hash": "abc", "seed": 3}


def test_round_trip_with_provenance(tmp_path):
    path = tmp_path / "x" / "t.parquet"
    io.write_parquet([{"a": 1, "b": [1, 2]}, {"a": 2, "b": None}], path, SCHEMA, PROV)
    frame = io.read_parquet(path, SCHEMA)
    assert frame["a"].to_list() == [1, 2] and frame["b"].to_list() == [[1, 2], None]
    assert frame.schema["b"] == pl.List(pl.Int32)
    assert io.read_provenance(path) == PROV
    assert [p.name for p in path.parent.iterdir()] == ["t.parquet"]  # no temporary left


def test_full_provenance_has_the_required_keys():
    prov = io.provenance("stage", "2", "hash", 7, extra="x")
    for key in ("stage", "stage_version", "config_hash", "seed", "git_commit", "packages"):
        assert key in prov
    assert prov["packages"]["torch"].startswith("2.13") and prov["extra"] == "x"


def test_same_input_same_bytes(tmp_path):
    rows = [{"a": i, "b": [i]} for i in range(10)]
    io.write_parquet(rows, tmp_path / "1.parquet", SCHEMA, PROV)
    io.write_parquet(rows, tmp_path / "2.parquet", SCHEMA, PROV)
    assert (tmp_path / "1.parquet").read_bytes() == (tmp_path / "2.parquet").read_bytes()


def test_frame_is_cast_to_the_schema(tmp_path):
    frame = pl.DataFrame({"a": [1, 2], "b": [[1], [2, 3]]})  # polars makes int64 lists
    io.write_parquet(frame, tmp_path / "t.parquet", SCHEMA, PROV)
    assert pl.read_parquet(tmp_path / "t.parquet").schema["b"] == pl.List(pl.Int32)


def test_wrong_columns_are_refused_and_nothing_is_written(tmp_path):
    path = tmp_path / "t.parquet"
    with pytest.raises(io.ArtifactError, match="t.parquet: columns"):
        io.write_parquet(pl.DataFrame({"a": [1]}), path, SCHEMA, PROV)
    with pytest.raises(io.ArtifactError, match="'a' has nulls"):
        io.write_parquet([{"a": None, "b": None}], path, SCHEMA, PROV)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "t.parquet"
    io.write_parquet([{"a": 1, "b": None}], path, SCHEMA, PROV)
    before = path.read_bytes()
    with pytest.raises(RuntimeError), io.atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash mid-write")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.parquet"]


def test_atomic_dir_replaces_whole_folders(tmp_path):
    target = tmp_path / "ckpt"
    with io.atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), io.atomic_dir(target) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError
    assert [p.name for p in target.iterdir()] == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_corrupt_and_missing_files_name_the_path(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(io.ArtifactError, match="bad.parquet: not a readable Parquet"):
        io.read_parquet(bad)
    with pytest.raises(io.ArtifactError, match="bad.parquet: not a readable Parquet"):
        io.read_provenance(bad)
    with pytest.raises(io.ArtifactError, match="gone.parquet: file not found"):
        io.read_parquet(tmp_path / "gone.parquet")
    plain = tmp_path / "plain.parquet"
    pl.DataFrame({"a": [1]}).write_parquet(plain)
    with pytest.raises(io.ArtifactError, match="no provenance"):
        io.read_provenance(plain)
    with pytest.raises(io.ArtifactError, match=r"missing columns \['b'\]"):
        io.read_parquet(plain, SCHEMA)
