"""Finding backends: the ``difftest.backends`` entry-point group and explicit plug-ins.

The project's own backends are registered through the same entry-point group as third-party
ones (see ``pyproject.toml``), so no module here names any backend. An entry point (or a
``--plugin``) may point to a backend class, a backend instance, a callable returning one or a
list of them, or a module that defines ``DIFFTEST_BACKENDS``. A plug-in is given as
``package.module:attr`` or as a path to a ``.py`` file.

A broken backend never aborts a run. An entry point that fails to load (or to build its
backends) becomes a :class:`BrokenBackend`, unavailable with the exception; every discovered
backend is a :class:`GuardedBackend`, whose availability probe and ``versions()`` run once and
make it unavailable, with the exception, if either raises. A ``--plugin`` the user named that
cannot be loaded is a :class:`RegistryError`: the command line was wrong; so is a backend
whose name is not one printable word, whose ``versions()`` returns anything but strings by
name (the report could not hold it), two backends of one name, a name that sets an option
twice (``[k_trim=off,k_trim=on]``) and two names that configure one backend.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from difftest.case.spec import Case
from difftest.contract.backend import (
    Availability,
    Backend,
    EmptyRowOutput,
    Precision,
    RunInputs,
    takes_options,
)

ENTRY_POINT_GROUP = "difftest.backends"


class RegistryError(RuntimeError):
    """A plug-in could not be loaded, or two backends share a name."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, as reasons and errors quote it."""
    return f"{type(exc).__name__}: {exc}"


class BrokenBackend:
    """A registered backend that could not even be built: unavailable, with the reason."""

    in_page_orders: tuple[str, ...] = ()

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def availability(self) -> Availability:
        """Never available."""
        return Availability(False, self.reason)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Every case: the reason it is broken."""
        return self.reason

    def precision(self, case: Case, device: torch.device) -> Precision:
        """Never asked for (never available)."""
        raise RuntimeError(self.reason)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """Never asked for (never available)."""
        raise RuntimeError(self.reason)

    def versions(self) -> dict[str, str]:
        """Nothing is known."""
        return {}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Never run (never available)."""
        raise RuntimeError(self.reason)


class GuardedBackend:
    """A discovered backend whose availability probe and ``versions()`` cannot abort a run.

    Both are called once, on first use (``versions()`` only when available); an exception
    from either makes the backend unavailable with the exception as the reason. Everything
    else is the wrapped backend's (its prepare, run and compare failures are per-case errors,
    :mod:`difftest.run.runner`).
    """

    def __init__(self, inner: Backend, origin: str = "") -> None:
        self.inner = inner
        self.name = inner.name
        self.in_page_orders = inner.in_page_orders
        self.origin = origin  # where it was found (a plug-in spec), for errors
        self._probed: tuple[Availability, dict[str, str]] | None = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _probe(self) -> tuple[Availability, dict[str, str]]:
        if self._probed is None:
            versions: dict[str, str] = {}
            try:
                availability = self.inner.availability()
            except Exception as exc:
                availability = Availability(False, f"its availability probe raised "
                                                   f"{describe(exc)}")
            if availability.available:  # an unavailable backend's versions are never asked
                try:
                    found = self.inner.versions()
                except Exception as exc:
                    availability = Availability(False, f"its versions() raised {describe(exc)}")
                else:
                    versions = self._checked(found)
            self._probed = availability, versions
        return self._probed

    def _checked(self, versions: object) -> dict[str, str]:
        """``versions`` as the report holds them; :class:`RegistryError` when they are not
        strings by name (a plug-in's mistake: the command line named a wrong backend)."""
        if not (isinstance(versions, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in versions.items())):
            where = f"{self.origin}: " if self.origin else ""
            raise RegistryError(f"{where}backend {self.name!r}: versions() returned "
                                f"{versions!r:.120}, which a report cannot hold (allowed: a "
                                "mapping of strings to strings)")
        return dict(versions)

    def availability(self) -> Availability:
        """The wrapped backend's, or unavailable with what its probe or versions raised."""
        return self._probe()[0]

    def versions(self) -> dict[str, str]:
        """The wrapped backend's versions (none if they raised)."""
        return self._probe()[1]

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """The wrapped backend's."""
        return self.inner.unsupported_reason(case, device)

    def precision(self, case: Case, device: torch.device) -> Precision:
        """The wrapped backend's."""
        return self.inner.precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The wrapped backend's."""
        return self.inner.empty_row_output(case)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The wrapped backend's output."""
        return self.inner.run(inputs)


def guard(backend: Backend, origin: str = "") -> Backend:
    """``backend`` as a :class:`GuardedBackend` (unchanged if it is one, or broken);
    ``origin``: where it was found, for errors."""
    if isinstance(backend, (GuardedBackend, BrokenBackend)):
        return backend
    return GuardedBackend(backend, origin)


def check_name(name: object, origin: str) -> str:
    """A backend's name, one printable word (it is printed on one line and stored in
    reports); :class:`RegistryError` naming ``origin`` otherwise."""
    if not (isinstance(name, str) and name and name.isprintable()
            and not any(c.isspace() for c in name)):
        raise RegistryError(f"{origin}: backend name {name!r:.80} is not allowed (allowed: "
                            "printable text without spaces)")
    return name


def _as_backends(obj: Any, origin: str) -> list[Backend]:
    if isinstance(obj, ModuleType):
        if not hasattr(obj, "DIFFTEST_BACKENDS"):
            raise RegistryError(f"{origin}: module defines no DIFFTEST_BACKENDS")
        return _as_backends(obj.DIFFTEST_BACKENDS, origin)
    if inspect.isclass(obj) or (callable(obj) and not isinstance(obj, Backend)):
        try:
            obj = obj()
        except Exception as exc:
            raise RegistryError(f"{origin}: calling {getattr(obj, '__name__', obj)!r} raised "
                                f"{describe(exc)}") from exc
    if isinstance(obj, Backend):
        return [obj]
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        found: list[Backend] = []
        for item in obj:
            found.extend(_as_backends(item, origin))
        return found
    raise RegistryError(f"{origin}: {obj!r} is not a difftest Backend")


def _import_from_here(target: str) -> ModuleType:
    """Import the module ``target``; when its top-level package is not importable, also
    from the current directory, as ``python -m`` would (the console script's ``sys.path``
    lacks it). The directory goes last, so it never shadows an installed module."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != target.partition(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(target)


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
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.append(str(Path.cwd()))  # as `python -m` would: a checkout's own modules
        try:
            module = _import_from_here(target)
        except Exception as exc:  # ImportError, or whatever the module raises as it loads
            raise RegistryError(f"--plugin {spec}: {type(exc).__name__}: {exc}") from exc
    if attr and not hasattr(module, attr):
        raise RegistryError(f"--plugin {spec}: {target} has no attribute {attr!r}")
    obj = getattr(module, attr) if attr else module
    return _as_backends(obj, f"--plugin {spec}")


def entry_point_backends() -> list[Backend]:
    """Every backend registered under the ``difftest.backends`` entry-point group.

    An entry point that fails to load or to build its backends is one :class:`BrokenBackend`
    named after the entry point: a broken plug-in must not hide the others.
    """
    found: list[Backend] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            found.extend(_as_backends(ep.load(), f"entry point {ep.name}"))
        except Exception as exc:
            found.append(BrokenBackend(ep.name, f"entry point {ep.name} = {ep.value} failed "
                                                f"to load: {describe(exc)}"))
    return found


def discover(plugins: Iterable[str] = ()) -> dict[str, Backend]:
    """All known backends by name: entry points first, then ``plugins`` in order."""
    backends: dict[str, Backend] = {}
    sources = [("", entry_point_backends())] + [(f"--plugin {p}", load_plugin(p))
                                                for p in plugins]
    for origin, group in sources:
        for backend in group:
            check_name(backend.name, origin or "an entry point")
            if backend.name in backends:
                raise RegistryError(f"two backends are named {backend.name!r}")
            backends[backend.name] = guard(backend, origin)
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
    """``a,b[k=v,k2=v2],c`` -> ``["a", "b[k=v,k2=v2]", "c"]`` (commas inside ``[...]`` stay).

    Unbalanced brackets are a :class:`RegistryError` quoting the text.
    """
    names, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or (i == len(text) and depth):
            raise RegistryError(f"backend list {text!r}: unbalanced '[' and ']'")
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
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in inner.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise RegistryError(f"backend {name!r}: option {item!r} is not key=value")
        if key.strip() in options:
            raise RegistryError(f"backend {name!r}: option {key.strip()!r} is given twice "
                                "(each option once)")
        options[key.strip()] = value.strip()
    return base, options


def select(available: dict[str, Backend], names: Iterable[str]) -> list[Backend]:
    """The backends called ``names``, in that order; unknown names are an error, and so are
    two names of one backend (``x[k=default]`` is ``x``: it would run twice under one name).

    ``base[key=value,...]`` configures a registered backend through its ``with_options``.
    """
    names = list(names)
    chosen = _chosen(available, names)
    given: dict[str, str] = {}
    for name, backend in zip(names, chosen, strict=True):
        if backend.name in given:
            raise RegistryError(f"backends {given[backend.name]!r} and {name!r} are one "
                                f"backend, {backend.name!r} (name each backend once)")
        given[backend.name] = name
    return chosen


def _chosen(available: dict[str, Backend], names: Iterable[str]) -> list[Backend]:
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
        if not options or not takes_options(backend):
            raise RegistryError(f"backend {base!r} takes no options (got {name!r})")
        try:
            chosen.append(guard(backend.with_options(options), getattr(backend, "origin", "")))
        except ValueError as exc:  # a bad option: the name given was wrong
            raise RegistryError(f"backend {name!r}: {exc}") from exc
        except Exception as exc:  # the backend failed to configure itself
            chosen.append(BrokenBackend(name, f"configuring it raised {describe(exc)}"))
    return chosen
