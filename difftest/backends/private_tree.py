"""A package tree on disk, importable under a private top-level name.

vLLM release trees and AITER trees are executed this way: ``<prefix>.<path inside the
package>`` names the tree's files, every directory is an empty package (no ``__init__`` runs,
so neither package's serving or ROCm imports do), and a subclass says how one module file
runs (:meth:`PrivateTreeFinder.run_file`), typically with its import lines pointed at the
prefix.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import types
from pathlib import Path


class PrivateTreeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<prefix>.<path inside package>`` in one tree; directories are empty packages
    whose children only this finder finds."""

    def __init__(self, package: Path, prefix: str) -> None:
        self.package = package
        self.prefix = prefix

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for names under the prefix, ``None`` for every other name."""
        if fullname != self.prefix and not fullname.startswith(self.prefix + "."):
            return None
        location = self.package.joinpath(*fullname.split(".")[1:])
        if location.is_dir():
            spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            spec.submodule_search_locations = []  # no path: only this finder finds children
            return spec
        if location.with_suffix(".py").is_file():
            return importlib.machinery.ModuleSpec(fullname, self,
                                                  origin=str(location.with_suffix(".py")))
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """Default module creation."""
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Packages stay empty; a module file runs through :meth:`run_file`."""
        spec = module.__spec__
        if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
            return
        path = Path(spec.origin)
        module.__file__ = str(path)
        self.run_file(module, path)

    def run_file(self, module: types.ModuleType, path: Path) -> None:
        """Execute the file at ``path`` into ``module``."""
        raise NotImplementedError
