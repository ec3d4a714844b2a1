"""difftest: cross-backend differential testing of sparse paged-attention decode kernels.

The package's public face (docs/plugins.md): what a plug-in backend implements and receives,
how it states its kernel calls and registers, and what a script needs to run cases through
backends. ``from difftest import Backend, RunInputs, kernel_call, run_case, ...``; the
modules behind them are the package's layers (docs/architecture.md) and may move.

Every name loads on first use (PEP 562): ``import difftest``, which the pytest plugin does in
every pytest run of the environment, imports no torch and no other difftest module.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_HOMES: dict[str, tuple[str, ...]] = {
    # the backend protocol: what a plug-in implements and declares
    "difftest.contract.backend": (
        "Backend", "ReferenceBackend", "ConfigurableBackend", "Availability", "Precision",
        "EmptyRowOutput", "Reference", "RunInputs"),
    # what a backend receives: the case, its stored data, its rows and its cache views
    "difftest.case.spec": ("Case", "CaseError"),
    "difftest.inputs.case_data": ("CaseData", "Segments"),
    "difftest.case.selection": ("SparseRow", "Segment"),
    "difftest.inputs.kv_cache": ("CacheViews",),
    # what a backend states about each kernel call it makes
    "difftest.contract.kernel_call": (
        "kernel_call", "KernelCall", "length_classes", "id_classes", "scale_class"),
    # what a backend states so that `difftest export` can write its call as a script
    "difftest.contract.exported_call": ("ExportedCall", "KernelImport"),
    # registration and options in names
    "difftest.contract.registry": (
        "ENTRY_POINT_GROUP", "OptionSpec", "RegistryError", "discover", "select",
        "load_plugin"),
    # running cases from a script
    "difftest.backends.torch_ref": ("TorchReference",),
    "difftest.run.runner": ("run_case", "CaseResult", "BackendResult"),
    "difftest.results.records": ("Status",),
    "difftest.run.session": ("Session",),
    "difftest.generation.generate": ("generated_cases",),
    "difftest.generation.corpus": ("load_corpus",),
    "difftest.case.casefile": ("read_case",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [name for names in _HOMES.values() for name in names]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then a plain attribute)."""
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'difftest' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the module's own dunders."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
