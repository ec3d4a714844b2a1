"""The note a ``--jobs`` run and a ``pytest -n`` run print when their processes compile their
sources on every start (difftest/machine/bytecode.py)."""

from __future__ import annotations

import importlib.util
import py_compile
import sys
from pathlib import Path
from types import ModuleType

import pytest

from difftest.machine.bytecode import uncompiled, uncompiled_note


def _module(tmp_path: Path, compiled: bool) -> ModuleType:
    source = tmp_path / "somewhere" / "heavy.py"
    source.parent.mkdir(parents=True)
    source.write_text("VALUE = 1\n")
    if compiled:
        py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)))
    module = ModuleType("heavy")
    module.__file__ = str(source)
    return module


def test_sources_compiled_again_only_where_bytecode_is_neither_there_nor_written(
        tmp_path: Path) -> None:
    bare = _module(tmp_path / "bare", compiled=False)
    shipped = _module(tmp_path / "shipped", compiled=True)
    assert uncompiled(bare, dont_write=True)
    assert not uncompiled(bare, dont_write=False)  # the first process writes it
    assert not uncompiled(shipped, dont_write=True)
    assert not uncompiled(sys, dont_write=True)  # a built-in module has no source


def test_the_prefix_python_reads_is_where_it_looks(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``PYTHONPYCACHEPREFIX`` (``sys.pycache_prefix``) bytecode beside the source
    is not read: the module compiles unless the prefix holds it."""
    shipped = _module(tmp_path, compiled=True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    assert uncompiled(shipped, dont_write=True)
    py_compile.compile(shipped.__file__,
                       cfile=importlib.util.cache_from_source(shipped.__file__))
    assert not uncompiled(shipped, dont_write=True)


def test_the_note_names_the_jobs_and_the_settings(tmp_path: Path) -> None:
    note = uncompiled_note(8, module=_module(tmp_path / "a", compiled=False), dont_write=True)
    assert note is not None and "each of the 8 jobs" in note
    assert "PYTHONPYCACHEPREFIX=DIR" in note and "unset PYTHONDONTWRITEBYTECODE" in note
    assert uncompiled_note(8, module=_module(tmp_path / "b", compiled=True),
                           dont_write=True) is None
    workers = uncompiled_note(4, "pytest workers", _module(tmp_path / "c", compiled=False),
                              dont_write=True)
    assert workers is not None and "each of the 4 pytest workers compiles" in workers
