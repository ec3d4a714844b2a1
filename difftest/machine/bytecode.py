"""Whether the processes a run starts load compiled bytecode or compile their sources.

A ``--jobs`` run starts one process per job (and each job a preparation worker), ``pytest
-n`` one per worker, and each imports torch and vLLM: thousands of modules. Where their
bytecode is neither shipped nor written (``PYTHONDONTWRITEBYTECODE`` on an image without
``.pyc`` files, common in containers), every process compiles those sources again: on one
H100 machine 7.5 s of a job's start, and a warm main job took 23-25 s against 13-14 s with
the bytecode kept (docs/performance.md, "Goals and GPU numbers").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PREFIX_ENV = "PYTHONPYCACHEPREFIX"  # Python's own setting: where bytecode is written and read


def uncompiled(module: ModuleType, dont_write: bool | None = None) -> bool:
    """Whether a new process importing ``module`` compiles its source: its bytecode is not
    on disk where Python looks (beside it, or under ``PYTHONPYCACHEPREFIX``) and Python
    does not write it (``dont_write``: this interpreter's ``-B``/``PYTHONDONTWRITEBYTECODE``)."""
    dont_write = sys.flags.dont_write_bytecode if dont_write is None else dont_write
    source = getattr(module, "__file__", None)
    if not dont_write or not source or not source.endswith(".py"):
        return False
    return not Path(importlib.util.cache_from_source(source)).is_file()


def uncompiled_note(processes: int, what: str = "jobs", module: ModuleType | None = None,
                    dont_write: bool | None = None) -> str | None:
    """A line for a run of ``processes`` (``what``: jobs, pytest workers) whose imports
    compile torch's sources each time (:func:`uncompiled`), with the settings that compile
    them once; else ``None``."""
    if module is None:
        import torch as module
    if not uncompiled(module, dont_write):
        return None
    return (f"python bytecode: not shipped and not written (PYTHONDONTWRITEBYTECODE): each of "
            f"the {processes} {what} compiles the torch and vLLM sources it imports, seconds "
            f"of its start; unset PYTHONDONTWRITEBYTECODE and set {PREFIX_ENV}=DIR (a "
            "directory CI keeps, as it keeps DIFFTEST_KERNEL_CACHE) to compile them once")
