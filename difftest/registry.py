"""Finding backends: the ``difftest.backends`` entry-point group and explicit plug-ins.

The project's own backends are registered through the same entry-point group as third-party
ones (see ``pyproject.toml``), so no module here names any backend. An entry point (or a
``--plugin``) may point to a backend class, a backend instance, a callable returning one or a
list of them, or a module that defines ``DIFFTEST_BACKENDS``. A plug-in is given as
``package.module:attr`` or as a path to a ``.py`` file.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from difftest.backend import Backend, ConfigurableBackend

ENTRY_POINT_GROUP = "difftest.backends"


class RegistryError(RuntimeError):
    """A plug-in could not be loaded, or two backends share a name."""


def _as_backends(obj: Any, origin: str) -> list[Backend]:
    if isinstance(obj, ModuleType):
        if not hasattr(obj, "DIFFTEST_BACKENDS"):
            raise RegistryError(f"{origin}: module defines no DIFFTEST_BACKENDS")
        return _as_backends(obj.DIFFTEST_BACKENDS, origin)
    if inspect.isclass(obj):
        obj = obj()
    elif callable(obj) and not isinstance(obj, Backend):
        obj = obj()
    if isinstance(obj, Backend):
        return [obj]
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        found: list[Backend] = []
        for item in obj:
            found.extend(_as_backends(item, origin))
        return found
    raise RegistryError(f"{origin}: {obj!r} is not a difftest Backend")


def load_plugin(spec: str) -> list[Backend]:
    """Backends from ``module:attr``, ``module`` or ``path/to/file.py[:attr]``."""
    target, _, attr = spec.partition(":")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise RegistryError(f"--plugin {spec}: no file {path}")
        name = f"difftest_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise RegistryError(f"--plugin {spec}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise RegistryError(f"--plugin {spec}: importing {path} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # ImportError, or whatever the module raises as it loads
            raise RegistryError(f"--plugin {spec}: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, attr) if attr else module
    return _as_backends(obj, f"--plugin {spec}")


def entry_point_backends() -> list[Backend]:
    """Every backend registered under the ``difftest.backends`` entry-point group."""
    found: list[Backend] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plug-in must not hide the others
            raise RegistryError(f"entry point {ep.name} = {ep.value}: {exc}") from exc
        found.extend(_as_backends(obj, f"entry point {ep.name}"))
    return found


def discover(plugins: Iterable[str] = ()) -> dict[str, Backend]:
    """All known backends by name: entry points first, then ``plugins`` in order."""
    backends: dict[str, Backend] = {}
    sources = [entry_point_backends()] + [load_plugin(p) for p in plugins]
    for group in sources:
        for backend in group:
            if backend.name in backends:
                raise RegistryError(f"two backends are named {backend.name!r}")
            backends[backend.name] = backend
    return backends


@dataclass(frozen=True)
class OptionSpec:
    """The options a backend accepts in its name, ``base[key=value,...]``.

    ``choices[key]`` lists the allowed values, the default first. The canonical name lists the
    options that differ from their defaults, sorted by key, so a report's backend name states
    the exact configuration.
    """

    base: str
    choices: Mapping[str, tuple[str, ...]]

    def parse(self, options: Mapping[str, str]) -> dict[str, str]:
        """Every option, defaults filled in; ``ValueError`` naming an unknown key or value."""
        for key, value in options.items():
            if key not in self.choices:
                known = ", ".join(sorted(self.choices)) or "none"
                raise ValueError(f"{self.base}: unknown option {key!r} (options: {known})")
            if value not in self.choices[key]:
                raise ValueError(f"{self.base}: {key}={value!r} is not one of "
                                 f"{', '.join(self.choices[key])}")
        return {key: options.get(key, allowed[0]) for key, allowed in self.choices.items()}

    def name(self, values: Mapping[str, str]) -> str:
        """``base`` plus the non-default options (what :func:`parse_name` reads back)."""
        changed = [f"{k}={values[k]}" for k in sorted(values) if values[k] != self.choices[k][0]]
        return f"{self.base}[{','.join(changed)}]" if changed else self.base


def split_names(text: str) -> list[str]:
    """``a,b[k=v,k2=v2],c`` -> ``["a", "b[k=v,k2=v2]", "c"]`` (commas inside ``[...]`` stay)."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            if text[start:i].strip():
                names.append(text[start:i].strip())
            start = i + 1
    return names


def parse_name(name: str) -> tuple[str, dict[str, str]]:
    """``base[key=value,...]`` -> ``(base, {key: value})``; a plain name has no options."""
    if not name.endswith("]") or "[" not in name:
        return name, {}
    base, _, inner = name[:-1].partition("[")
    options = {}
    for item in filter(None, (part.strip() for part in inner.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise RegistryError(f"backend {name!r}: option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    return base, options


def select(available: dict[str, Backend], names: Iterable[str]) -> list[Backend]:
    """The backends called ``names``, in that order; unknown names are an error.

    ``base[key=value,...]`` configures a registered backend through its ``with_options``.
    """
    chosen = []
    for name in names:
        if name in available:
            chosen.append(available[name])
            continue
        base, options = parse_name(name)
        if base not in available:
            known = ", ".join(sorted(available))
            raise RegistryError(f"unknown backend {name!r}; known backends: {known}")
        backend = available[base]
        if not options or not isinstance(backend, ConfigurableBackend):
            raise RegistryError(f"backend {base!r} takes no options (got {name!r})")
        try:
            chosen.append(backend.with_options(options))
        except ValueError as exc:
            raise RegistryError(f"backend {name!r}: {exc}") from exc
    return chosen
