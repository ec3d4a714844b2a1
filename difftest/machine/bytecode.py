"""Whether the processes a run starts load compiled bytecode or compile their sources.

A ``--jobs`` run starts one process per job (and each job a preparation worker), and each
imports torch and vLLM: thousands of modules. Where their bytecode is neither shipped nor
written (``PYTHONDONTWRITEBYTECODE`` on an image without ``.pyc`` files, common in
containers), every process compiles those sources again: 7.5 s of a job's start on one H100
machine, most of a warm main job's wall (docs/performance.md, "Jobs on a GPU").
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


def uncompiled_note(jobs: int, module: ModuleType | None = None,
                    dont_write: bool | None = None) -> str | None:
    """A line for a run of ``jobs`` processes whose imports compile torch's sources each
    time (:func:`uncompiled`), with the settings that compile them once; else ``None``."""
    if module is None:
        import torch as module
    if not uncompiled(module, dont_write):
        return None
    return (f"python bytecode: not shipped and not written (PYTHONDONTWRITEBYTECODE): each of "
            f"the {jobs} jobs compiles the torch and vLLM sources it imports, seconds of its "
            f"start; unset PYTHONDONTWRITEBYTECODE and set {PREFIX_ENV}=DIR (a directory CI "
            "keeps, as it keeps DIFFTEST_KERNEL_CACHE) to compile them once")
