"""Checkpoints: nothing lost, nothing hidden.

Integrity: the commit marker records the size and crc32 of every file DCP wrote and the crc32 of every stored tensor
chunk (and its own); ``load`` checks them before DCP reads anything, so flipped bytes, truncation and deletion of a
shard file, of ``.metadata`` or of the marker are refused with a ``CheckpointError`` naming the file, and no DCP or
JSON exception reaches the caller raw.

Atomic overwrite: a save that crashes at any step of its commit (simulated in one process by making the step
raise) leaves a checkpoint that ``load`` reads -- the previous one or the new one, with a warning naming the
directory it used -- and the next save removes the leftovers.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

import autoshard
from autoshard.api import checkpoint
from autoshard.api.checkpoint import MARKER
from autoshard.errors import CheckpointError
from autoshard.runtime import SimWorld
from examples import models


def trained(seed: int = 0, steps: int = 1):
    """An mlp and an Adam after ``steps`` steps (so ``exp_avg_sq`` is not zero)."""
    model, (x, t), _ = models.mlp()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(x, t).backward()
        opt.step()
    return model, opt


def fresh():
    model = models.mlp()[0]
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def load_into_fresh(path: str):
    model, opt = fresh()
    autoshard.load(model, path, optimizer=opt)
    return model, opt


def our_warnings(record) -> list[str]:
    """autoshard's checkpoint warnings (DCP warns about single-process use on every call: ignored)."""
    return [str(w.message) for w in record if "torch.distributed is disabled" not in str(w.message)]


# ---- integrity --------------------------------------------------------------------------------------------------
FILES = {"shard": "__0_0.distcp", "metadata": ".metadata", "marker": MARKER}


def flip(file_path: str, at: int, n: int = 64) -> None:
    data = bytearray(Path(file_path).read_bytes())
    for i in range(at, min(at + n, len(data))):
        data[i] ^= 0xFF
    Path(file_path).write_bytes(bytes(data))


def damage(path: str, kind: str, how: str) -> str:
    name = FILES[kind]
    file_path = os.path.join(path, name)
    if how == "flip":
        if kind == "shard":  # the case: 64 bytes inside exp_avg_sq's chunk, file size unchanged
            marker = json.loads(Path(path, MARKER).read_text())
            chunk = next(c for c in marker["integrity"]["files"][name]["chunks"]
                         if c["tensor"] == "optim.fc1.weight.exp_avg_sq")
            flip(file_path, chunk["start"] + chunk["length"] - 200)
        else:
            flip(file_path, os.path.getsize(file_path) // 2)
    elif how == "truncate":
        size = os.path.getsize(file_path)
        with open(file_path, "r+b") as f:
            f.truncate(size // 2)
    else:
        os.remove(file_path)
    return name


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", sorted(FILES))
def test_damaged_truncated_or_missing_files_are_refused_naming_the_file(tmp_path, kind, how):
    path = str(tmp_path / "ck")
    model, opt = trained()
    autoshard.save(model, path, optimizer=opt)
    load_into_fresh(path)  # intact: loads
    name = damage(path, kind, how)
    target, target_opt = fresh()
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(CheckpointError) as info:
        autoshard.load(target, path, optimizer=target_opt)
    msg = str(info.value)
    print(f"\n{kind}/{how}: {msg}")
    assert name in msg
    if kind == "shard" and how == "flip":
        assert "holds damaged data: tensor `optim.fc1.weight.exp_avg_sq` (chunk at offsets [0, 0]" in msg
    if kind == "marker" and how in ("flip", "truncate"):
        assert "has a damaged commit marker" in msg
        assert isinstance(info.value.__cause__, ValueError)  # the JSON (or UTF-8) error, chained
    # refused before anything was read into the model or its optimizer
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    assert target_opt.param_groups[0]["lr"] == 0.5 and not target_opt.state


def test_a_marker_edited_into_other_valid_json_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained()
    autoshard.save(model, path, optimizer=opt)
    marker_path = os.path.join(path, MARKER)
    text = Path(marker_path).read_text()
    assert '"lr": 0.01' in text
    Path(marker_path).write_text(text.replace('"lr": 0.01', '"lr": 0.09'))  # same size, still valid JSON
    with pytest.raises(CheckpointError, match=r"has a damaged commit marker '.*autoshard.json': its contents have "
                                              r"crc32 [0-9a-f]{8}, but the save wrote '[0-9a-f]{8}'"):
        load_into_fresh(path)


def test_marker_lists_size_and_crc32_of_every_file_and_chunk(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained()
    autoshard.save(model, path, optimizer=opt)
    marker = json.loads(Path(path, MARKER).read_text())
    assert marker["format"] == "autoshard-dcp/2" and re.fullmatch(r"[0-9a-f]{8}", marker["crc32"])
    files = marker["integrity"]["files"]
    assert marker["integrity"]["algorithm"] == "crc32"
    assert sorted(files) == sorted(n for n in os.listdir(path) if n != MARKER) == [".metadata", "__0_0.distcp"]
    for name, info in files.items():
        assert info["size"] == os.path.getsize(os.path.join(path, name))
    from torch.distributed.checkpoint import FileSystemReader

    keys = {i.fqn for i in FileSystemReader(path).read_metadata().storage_data}
    assert {c["tensor"] for c in files["__0_0.distcp"]["chunks"]} == keys  # every stored chunk has a checksum
    assert "optim.fc1.weight.exp_avg_sq" in keys


def test_a_simulated_sharded_load_refuses_a_damaged_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained()
    autoshard.save(model, path, optimizer=opt)
    damage(path, "shard", "flip")
    mesh = autoshard.Mesh(model=2)
    world = SimWorld(mesh, timeout=60)
    _, (x, t), _ = models.mlp()

    def body(rank):
        sharded = autoshard.compile(models.mlp()[0], mesh, (x, t), annotations=models.megatron(mesh, "mlp"),
                                    comm=world.communicator(rank), planner="greedy")
        autoshard.load(sharded, path)
        autoshard.load(sharded, path, optimizer=torch.optim.Adam(sharded.parameters()))

    with pytest.raises(CheckpointError, match=r"__0_0.distcp' holds damaged data: tensor `optim.fc1.weight"):
        world.run(body)


def test_dcp_errors_of_an_unverified_checkpoint_become_checkpoint_errors(tmp_path):
    """A checkpoint of format autoshard-dcp/1 (no checksums) loads with a warning; DCP's own exception for its
    truncated shard file (a CheckpointException, which is not an Exception) comes back as a CheckpointError."""
    path = str(tmp_path / "ck")
    model, opt = trained()
    autoshard.save(model, path, optimizer=opt)
    marker_path = os.path.join(path, MARKER)
    marker = json.loads(Path(marker_path).read_text())
    for key in ("crc32", "integrity", "saved_ns"):
        del marker[key]
    marker["format"] = checkpoint.FORMAT_V1
    Path(marker_path).write_text(json.dumps(marker))
    with pytest.warns(UserWarning, match=r"format 'autoshard-dcp/1', written without checksums: it loads unverified"):
        got, _ = load_into_fresh(path)
    assert torch.equal(got.fc1.weight, model.fc1.weight)
    damage(path, "shard", "truncate")
    with pytest.warns(UserWarning, match="written without checksums"), \
            pytest.raises(CheckpointError, match=r"could not be read.*: torch.distributed.checkpoint raised "
                                                 r"CheckpointException") as info:
        load_into_fresh(path)
    from torch.distributed.checkpoint.api import CheckpointException

    assert isinstance(info.value.__cause__, CheckpointException)


def test_a_failed_save_raises_checkpoint_error_and_leaves_nothing(tmp_path):
    model, opt = trained()
    path = str(tmp_path / "ck")
    autoshard.save(model, path, optimizer=opt)

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    with mock.patch("torch.distributed.checkpoint.filesystem.FileSystemWriter.finish", fail), \
            pytest.raises(CheckpointError, match=r"save to '.*ck' failed before its commit: CheckpointException "
                                                 r"\(OSError: \[Errno 28\] No space left on device\)\. Nothing was "
                                                 r"committed: '.*ck' is unchanged and the partial data was removed"):
        autoshard.save(trained(seed=1)[0], path)
    assert os.listdir(tmp_path) == ["ck"]
    got, _ = load_into_fresh(path)
    assert torch.equal(got.fc1.weight, model.fc1.weight)


# ---- atomic overwrite -------------------------------------------------------------------------------------------
class Crash(BaseException):
    """The process dying at this point (not an Exception: nothing in autoshard may catch and tidy it)."""


def crash_on(name: str, call: int = 1):
    """A patch for ``checkpoint.<name>`` that raises Crash on its ``call``-th use."""
    real = getattr(checkpoint, name)
    calls = [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise Crash(f"crash in {name} call {call}")
        return real(*args, **kwargs)

    return mock.patch.object(checkpoint, name, step)


# crash point: (patch, which checkpoint load reads afterwards, the warning it gives)
LEFT_BESIDE = r"loading '.*ck' itself, the last committed checkpoint"
CRASHES = {
    # every file written, the checksums not yet taken: the new directory has no marker
    "after-data": (lambda: crash_on("_integrity"), "old",
                   LEFT_BESIDE + r"\. Leftovers of interrupted saves sit beside it \(\['ck\.tmp-"),
    # the marker written to autoshard.json.part, not yet renamed into place
    "marker-rename": (lambda: crash_on("_rename", 1), "old", LEFT_BESIDE + r"\."),
    # the new directory complete, the old one not yet moved aside: not committed
    "before-swap": (lambda: crash_on("_rename", 2), "old",
                    LEFT_BESIDE + r"; \['.*ck\.tmp-[0-9a-f]{32}'\] hold\(s\) a complete save that was interrupted "
                    r"before its commit, not loaded"),
    # the old one moved aside, the new one not yet renamed into place: nothing at the path
    "between-renames": (lambda: crash_on("_rename", 3), "new",
                        (r"checkpoint '.*ck' is missing: a save to it was interrupted between moving the previous "
                         r"checkpoint aside and renaming the new one into place\. Loading the new checkpoint from "
                         r"'.*ck\.tmp-[0-9a-f]{32}' .*; also left over: \['ck\.old-[0-9a-f]{32}'\]")),
    # swapped, the old one not yet removed
    "before-cleanup": (lambda: crash_on("_discard", 1), "new",
                       LEFT_BESIDE + r"\. Leftovers of interrupted saves sit beside it \(\['ck\.old-"),
    # the old one's marker removed, its files half gone
    "mid-cleanup": (lambda: crash_on("_rmtree", 1), "new", LEFT_BESIDE + r"\."),
}


@pytest.mark.parametrize("point", list(CRASHES))
def test_an_overwriting_save_that_crashes_leaves_a_checkpoint_that_loads(tmp_path, point):
    patch, expect, warning = CRASHES[point]
    path = str(tmp_path / "ck")
    old, old_opt = trained(seed=0)
    new, new_opt = trained(seed=1, steps=2)
    autoshard.save(old, path, optimizer=old_opt)
    with patch(), pytest.raises(Crash):
        autoshard.save(new, path, optimizer=new_opt)
    print(f"\n{point}: left {sorted(os.listdir(tmp_path))}")
    with pytest.warns(UserWarning, match=warning) as record:
        got, got_opt = load_into_fresh(path)
    print(our_warnings(record)[0])
    want, want_opt = (old, old_opt) if expect == "old" else (new, new_opt)
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(got_opt.state[got.fc1.weight]["exp_avg_sq"], want_opt.state[want.fc1.weight]["exp_avg_sq"])

    # the next save removes every leftover, and its checkpoint loads without a warning
    third, third_opt = trained(seed=2)
    autoshard.save(third, path, optimizer=third_opt)
    assert os.listdir(tmp_path) == ["ck"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, _ = load_into_fresh(path)
    assert our_warnings(record) == []
    assert torch.equal(got.fc1.weight, third.fc1.weight)


def test_a_first_save_that_crashes_before_its_rename_loads_from_its_directory(tmp_path):
    path = str(tmp_path / "ck")
    new, opt = trained(seed=1)
    with crash_on("_rename", 2), pytest.raises(Crash):  # marker in place; tmp -> path is the second rename
        autoshard.save(new, path, optimizer=opt)
    with pytest.warns(UserWarning, match=r"Loading the new checkpoint from '.*ck\.tmp-[0-9a-f]{32}'"):
        got, _ = load_into_fresh(path)
    assert torch.equal(got.fc1.weight, new.fc1.weight)


def test_the_newest_complete_leftover_wins(tmp_path):
    """Two crashed saves after the last committed one: the one that got furthest (the newer) is loaded."""
    path = str(tmp_path / "ck")
    a, b, c = (trained(seed=s)[0] for s in range(3))
    autoshard.save(a, path)
    with crash_on("_rename", 2), pytest.raises(Crash):  # b: complete, never committed
        autoshard.save(b, path)
    with crash_on("_rename", 3), pytest.raises(Crash):  # c: a moved aside, c not renamed into place
        autoshard.save(c, path)
    assert len(os.listdir(tmp_path)) == 3
    got = fresh()[0]
    with pytest.warns(UserWarning, match=r"Loading the new checkpoint"):
        autoshard.load(got, path)
    assert torch.equal(got.fc1.weight, c.fc1.weight)


def test_a_simulated_sharded_save_that_crashes_between_its_renames_loads(tmp_path):
    path = str(tmp_path / "ck")
    mesh = autoshard.Mesh(model=2)
    _, (x, t), _ = models.mlp()
    old, new = trained(seed=0)[0], trained(seed=1)[0]
    autoshard.save(old, path)

    def body(rank, world, path):  # threads: each compiles a copy (no RNG use in threads)
        sharded = autoshard.compile(copy.deepcopy(new), mesh, (x, t), annotations=models.megatron(mesh, "mlp"),
                                    comm=world.communicator(rank), planner="greedy")
        autoshard.save(sharded, path)

    world = SimWorld(mesh, timeout=60)
    with crash_on("_rename", 3), pytest.raises(Crash):
        world.run(body, world, path)
    world = SimWorld(mesh, timeout=60)

    def reload(rank):
        sharded = autoshard.compile(models.mlp()[0], mesh, (x, t), annotations=models.megatron(mesh, "mlp"),
                                    comm=world.communicator(rank), planner="greedy")
        autoshard.load(sharded, path)
        return autoshard.full_state_dict(sharded)

    with pytest.warns(UserWarning, match=r"Loading the new checkpoint from '.*ck\.tmp-"):
        full = world.run(reload)[0]
    for k, v in new.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0)


# ---- the README's error catalogue -------------------------------------------------------------------------------
# Rows for README.md "Errors autoshard detects" (merged by hand) and a trigger for each, in the form of
# tests/test_error_catalogue.py's TRIGGERS (the lead adds CATALOGUE_TRIGGERS there along with the rows).
CATALOGUE_ROWS = """\
| `checkpoint-marker-damaged` | `CheckpointError` | the commit marker is not valid JSON, or its contents differ from its crc32 | has a damaged commit marker …autoshard.json': … it was changed after the save. Restore the file or save again. |
| `checkpoint-file-missing` | `CheckpointError` | a file the marker lists (a shard file, `.metadata`) is gone | is missing its file '…' (…), but its commit marker lists it: it was deleted or moved after the save. |
| `checkpoint-file-truncated` | `CheckpointError` | a file's size differs from the size the save wrote | has … bytes, but the save wrote …: it was truncated or overwritten after the save. |
| `checkpoint-file-damaged` | `CheckpointError` | a tensor chunk's (or a file's) crc32 differs from the marker's | holds damaged data: tensor `…` (chunk at offsets …, bytes …) has crc32 …, but the save wrote …: the file was changed after the save. |
| `checkpoint-file-unreadable` | `CheckpointError` | a listed file exists but cannot be read (permissions, I/O error) | checkpoint file … cannot be read: … |
| `checkpoint-read-failed` | `CheckpointError` | DCP fails to read a checkpoint without checksums (format autoshard-dcp/1) | could not be read…: torch.distributed.checkpoint raised … Restore its files or save again. |
| `checkpoint-save-failed` | `CheckpointError` | DCP or the file system fails while a single process (or the simulator) writes | failed before its commit: …. Nothing was committed: … is unchanged and the partial data was removed. |
| `checkpoint-commit-failed` | `CheckpointError` | a rename of the commit fails (the OS refuses) | failed during its commit: …. load(…) reads the last complete checkpoint |
"""


def _saved(d: str) -> str:
    model, opt = trained()
    autoshard.save(model, f"{d}/ck", optimizer=opt)
    return f"{d}/ck"


def _load(path: str):
    return load_into_fresh(path)


def _marker_damaged(d):
    path = _saved(d)
    damage(path, "marker", "truncate")
    _load(path)


def _file_missing(d):
    path = _saved(d)
    damage(path, "shard", "delete")
    _load(path)


def _file_truncated(d):
    path = _saved(d)
    damage(path, "metadata", "truncate")
    _load(path)


def _file_damaged(d):
    path = _saved(d)
    damage(path, "shard", "flip")
    _load(path)


def _file_unreadable(d):
    path = _saved(d)
    real = checkpoint._scan

    def scan(file_path, chunks):
        if file_path.endswith(".distcp"):
            raise PermissionError(13, "Permission denied", file_path)
        return real(file_path, chunks)

    with mock.patch.object(checkpoint, "_scan", scan):
        _load(path)


def _read_failed(d):
    path = _saved(d)
    marker = json.loads(Path(path, MARKER).read_text())
    marker = {k: v for k, v in marker.items() if k not in ("crc32", "integrity", "saved_ns")}
    Path(path, MARKER).write_text(json.dumps(dict(marker, format=checkpoint.FORMAT_V1)))
    damage(path, "shard", "truncate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load(path)


def _save_failed(d):
    open(f"{d}/file", "w").close()
    autoshard.save(models.mlp()[0], f"{d}/file/ck")  # a directory inside a regular file


def _commit_failed(d):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", src)

    with mock.patch.object(checkpoint, "_rename", refuse):
        autoshard.save(models.mlp()[0], f"{d}/ck")


def _ckpt(fn):
    def run():
        with tempfile.TemporaryDirectory() as d:
            fn(d)
    return run


CATALOGUE_TRIGGERS = {
    "checkpoint-marker-damaged": _ckpt(_marker_damaged),
    "checkpoint-file-missing": _ckpt(_file_missing),
    "checkpoint-file-truncated": _ckpt(_file_truncated),
    "checkpoint-file-damaged": _ckpt(_file_damaged),
    "checkpoint-file-unreadable": _ckpt(_file_unreadable),
    "checkpoint-read-failed": _ckpt(_read_failed),
    "checkpoint-save-failed": _ckpt(_save_failed),
    "checkpoint-commit-failed": _ckpt(_commit_failed),
}


def _rows() -> dict[str, tuple[str, str]]:
    out = {}
    for line in CATALOGUE_ROWS.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        out[cells[0].strip("`")] = (cells[1].strip("`"), cells[3])
    return out


@pytest.mark.parametrize("rid", sorted(CATALOGUE_TRIGGERS))
def test_catalogue_rows(rid):
    """Each new row's trigger raises its class with the excerpt's pieces in order (test_error_catalogue's rule)."""
    cls_name, excerpt = _rows()[rid]
    with pytest.raises(CheckpointError) as info:
        CATALOGUE_TRIGGERS[rid]()
    assert type(info.value).__name__ == cls_name
    message, at = str(info.value), 0
    for piece in (p.strip() for p in excerpt.split("…")):
        if piece:
            where = message.find(piece, at)
            assert where >= 0, f"{rid}: {piece!r} not in (the rest of) {message!r}"
            at = where + len(piece)
    assert sorted(_rows()) == sorted(CATALOGUE_TRIGGERS)
