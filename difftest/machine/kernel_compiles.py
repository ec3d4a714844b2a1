"""Triton kernel specializations: what a run compiles, and where compiled kernels are kept.

A ``@triton.jit`` kernel is compiled once per specialization: its arguments' types, its
constexpr values, its launch options and, for each integer and pointer argument not listed
in ``do_not_specialize`` (``do_not_specialize_on_alignment`` for this part alone), whether it
is divisible by 16 (an integer equal to 1 becomes a constant). :func:`specialization_key` is
the key Triton's JIT caches a launch under (Triton's own binder, with the NVIDIA backend's
rules), computed for a compiled and an interpreted kernel alike, so the specializations a
run would compile on a GPU are counted on the CPU too.

:class:`KernelCompiles` counts a process's compilations by stage (the reference, each
backend, and ``framework``: generation, cache builds, comparison): on a GPU those Triton
compiled and those it loaded from its cache, with their seconds (Triton's compilation
listener); under the interpreter, which compiles nothing, the specializations a GPU would
have compiled (each counted in the stage that first launched it).

:func:`use_kernel_cache`: ``DIFFTEST_KERNEL_CACHE`` names the directory compiled kernels are
kept in (it sets Triton's ``TRITON_CACHE_DIR``; without either, Triton's ``~/.triton/cache``),
the one directory a CI runner keeps between jobs.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import wraps
from typing import Any

KERNEL_CACHE_ENV = "DIFFTEST_KERNEL_CACHE"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
FRAMEWORK = "framework"  # launches outside the reference's and the backends' calls
_WRAPPED = "_difftest_counts_specializations"


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The directory compiled kernels are kept in: ``DIFFTEST_KERNEL_CACHE`` (which wins over
    a ``TRITON_CACHE_DIR`` also set), else ``TRITON_CACHE_DIR``, else Triton's default."""
    env = os.environ if environ is None else environ
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return (env.get(KERNEL_CACHE_ENV) or env.get(TRITON_CACHE_ENV)
            or os.path.join(home, ".triton", "cache"))


def use_kernel_cache(environ: MutableMapping[str, str] | None = None) -> str:
    """Point Triton's cache at ``DIFFTEST_KERNEL_CACHE`` when it is set (before the first
    compilation: Triton reads ``TRITON_CACHE_DIR`` at each); returns :func:`kernel_cache_dir`."""
    env = os.environ if environ is None else environ
    chosen = env.get(KERNEL_CACHE_ENV)
    if chosen:
        env[TRITON_CACHE_ENV] = chosen
    return kernel_cache_dir(env)


def specialization_key(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The key a compiled Triton JIT caches the launch ``kernel[grid](*args, **kwargs)``
    under: one compilation per distinct key (``kernel``: a ``JITFunction`` or, under
    ``TRITON_INTERPRET=1``, an ``InterpretedFunction``)."""
    _, specialization, options = _binder(kernel)(*args, **kwargs)
    return str(specialization) + str(options)


_BINDERS: dict[int, tuple[Any, Callable[..., Any]]] = {}


def _binder(kernel: Any) -> Callable[..., Any]:
    """Triton's argument binder for ``kernel``, built as its JIT builds it, with the
    specialization rules of the NVIDIA backend (the base backend's)."""
    held = _BINDERS.get(id(kernel))
    if held is not None and held[0] is kernel:
        return held[1]
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    settings = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted: jit's kwargs
    signature = inspect.signature(kernel.fn)
    listed = [set(settings.get(name) or ()) for name in
              ("do_not_specialize", "do_not_specialize_on_alignment")]
    params = [KernelParam(i, p, *(i in names or p.name in names for names in listed))
              for i, p in enumerate(signature.parameters.values())]
    binder = create_function_from_signature(signature, params, BaseBackend)
    _BINDERS[id(kernel)] = (kernel, binder)
    return binder


@dataclass
class StageCompiles:
    """One stage's compilations: compiled by Triton, loaded from its cache, and (under the
    interpreter) the specializations a GPU would compile."""

    compiled: int = 0
    compile_seconds: float = 0.0
    loaded: int = 0
    load_seconds: float = 0.0
    interpreted: int = 0

    def add(self, other: StageCompiles) -> None:
        """Add ``other``'s counts and seconds to this one's."""
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


class KernelCompiles:
    """A process's kernel compilations by stage, counted while :meth:`start`-ed."""

    def __init__(self) -> None:
        self.stages: dict[str, StageCompiles] = {}
        self._stage = threading.local()
        self._keys: set[tuple[int, str]] = set()  # interpreted: (kernel, key) already counted

    def start(self) -> KernelCompiles:
        """Count from now on (Triton's listener and the interpreted launches); returns self."""
        _install()
        _ACTIVE.add(self)
        return self

    def stop(self) -> None:
        """Stop counting."""
        _ACTIVE.discard(self)

    @property
    def current(self) -> str:
        """The stage launches are counted in now."""
        return getattr(self._stage, "name", FRAMEWORK)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Count what is compiled inside as ``name``'s (the reference or a backend)."""
        outer = self.current
        self._stage.name = name
        try:
            yield
        finally:
            self._stage.name = outer

    def _entry(self) -> StageCompiles:
        return self.stages.setdefault(self.current, StageCompiles())

    def compiled(self, seconds: float, cache_hit: bool) -> None:
        """Triton compiled (or, ``cache_hit``, loaded from its cache) one specialization."""
        entry = self._entry()
        if cache_hit:
            entry.loaded += 1
            entry.load_seconds += seconds
        else:
            entry.compiled += 1
            entry.compile_seconds += seconds

    def launched(self, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """An interpreted launch: count its specialization the first time it is seen."""
        try:
            key = (id(kernel), specialization_key(kernel, args, kwargs))
        except Exception:  # a launch Triton's binder cannot bind fails in the launch itself
            return
        if key not in self._keys:
            self._keys.add(key)
            self._entry().interpreted += 1

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Per stage, its counts and seconds (JSON-ready; a report's ``kernel_compiles``)."""
        return {name: asdict(entry) for name, entry in sorted(self.stages.items())}


def merged(summaries: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Several processes' :meth:`KernelCompiles.to_dict`, added stage by stage."""
    total: dict[str, StageCompiles] = {}
    for summary in summaries:
        for name, entry in summary.items():
            total.setdefault(name, StageCompiles()).add(StageCompiles(**entry))
    return {name: asdict(entry) for name, entry in sorted(total.items())}


def describe(summary: Mapping[str, Mapping[str, float]], cache_dir: str | None = None) -> str:
    """One line: how many specializations were compiled and in how long, per stage, and
    those loaded from the cache; or, interpreted, that nothing was compiled and what a GPU
    would have compiled."""
    stages = {name: StageCompiles(**entry) for name, entry in summary.items()}
    total = StageCompiles()
    for entry in stages.values():
        total.add(entry)
    where = f" ({cache_dir})" if cache_dir else ""
    if not (total.compiled or total.loaded or total.interpreted):
        return "kernels: no Triton kernel launched"
    if total.compiled or total.loaded:
        parts = ", ".join(f"{name} {e.compiled} in {e.compile_seconds:.1f} s"
                          for name, e in stages.items() if e.compiled)
        line = (f"kernels: {total.compiled} specializations compiled in "
                f"{total.compile_seconds:.1f} s" + (f" ({parts})" if parts else "")
                + f"; {total.loaded} loaded from the kernel cache{where} in "
                f"{total.load_seconds:.1f} s")
        if total.interpreted:
            line += f"; {total.interpreted} more interpreted"
        return line
    parts = ", ".join(f"{name} {e.interpreted}" for name, e in stages.items() if e.interpreted)
    return (f"kernels: interpreted (TRITON_INTERPRET=1), none compiled; a GPU would compile "
            f"{total.interpreted} specializations ({parts})")


_ACTIVE: weakref.WeakSet[KernelCompiles] = weakref.WeakSet()
_INSTALL_LOCK = threading.Lock()


def _install() -> None:
    """Install, once per process, Triton's compilation listener and the interpreted launch
    counter that report to the started :class:`KernelCompiles`."""
    with _INSTALL_LOCK:
        try:
            from triton import knobs
            from triton.runtime import interpreter
        except ImportError:  # no Triton, or one without knobs (before 3.4): nothing to count
            return
        compilation = getattr(knobs, "compilation", None)
        listener = getattr(compilation, "listener", None)
        if hasattr(compilation, "listener") and not getattr(listener, _WRAPPED, False):
            compilation.listener = _listening(listener)
        run = interpreter.InterpretedFunction.run
        if not getattr(run, _WRAPPED, False):
            interpreter.InterpretedFunction.run = _counting(run)


def _listening(previous: Callable[..., None] | None) -> Callable[..., None]:
    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        try:  # microseconds; a Triton whose CompileTimes differ still compiles, untimed
            micro = times.ir_initialization + sum(t for _, t in times.lowering_stages)
            seconds = (micro + times.store_results) / 1e6
        except (AttributeError, TypeError, ValueError):
            seconds = 0.0
        for compiles in list(_ACTIVE):
            compiles.compiled(seconds, cache_hit)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)

    setattr(listener, _WRAPPED, True)
    return listener


def _counting(run: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(run)
    def counted(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        for compiles in list(_ACTIVE):
            compiles.launched(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    setattr(counted, _WRAPPED, True)
    return counted
