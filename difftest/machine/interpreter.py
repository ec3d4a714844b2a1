"""Triton's interpreter without its repeated patching of ``triton.language`` inside a launch.

Under ``TRITON_INTERPRET=1`` a launch (``GridExecutor.__call__``) patches the builtins of the
``triton.language`` modules the kernel sees for the interpreter, runs the grid, and restores
them. Each call of one ``@triton.jit`` function from another (``InterpretedFunction.__call__``)
patches them again, though they are patched already: ``inspect.getmembers`` over
``triton.language``, its ``tensor`` and ``math``, about 0.8 ms a call, 22% of the generated
cases' time on the CPU (vLLM's kernels call small helpers in their loops; measured in
docs/performance.md). Those re-patches set the same attributes to equivalent wrappers and are
undone with the launch's own patches, so skipping them runs the same functions on the same
values: :func:`skip_nested_patching` skips a nested call's patching when the callee sees no
``triton.language`` module that the running launch has not patched. Other calls (a launch, a
nested callee that sees another module, a call outside any launch) patch as before. A nested
callee's patches (a module the launch did not patch, e.g. ``triton.language.core`` seen from
``tl.sum``) are undone with the launch's own, before them: Triton leaves them in place, so
after any interpreted launch ``triton.language.core``'s builtins were still the interpreter's,
and a kernel compiled later in the process (:mod:`difftest.machine.triton_compile`) failed on
them (finding F33).

:func:`skip_dropped_overflow_checks`: the interpreter's options keep ``sanitize_overflow`` on,
so every int32 add, sub and mul is evaluated a second time in int64 and turned into an
overflow condition, which ``device_assert`` then drops because ``debug`` is off (it asserts
only under ``debug``, on a GPU as in the interpreter): 40% of the interpreted time of a
generated case (docs/performance.md), for no check. Off, the same values are computed and
nothing that could raise is removed; with ``debug`` on the checks stay.

:func:`decode_fp8_specials`: the interpreter converts fp8 by moving exponent and mantissa
bits, with no case for the formats' special values, so fp8 NaN and Inf bytes become finite
numbers (Triton 3.8.0: e4m3fn ``0x7F`` -> 480, e4m3fnuz ``0x80`` -> -0.0, e5m2 ``0x7F`` ->
114688) and float NaN becomes a finite fp8 byte. A kernel that reads a NaN canary of an fp8
cache then agrees on the CPU where it fails on a GPU (docs/geometry.md). The wrapped
conversion gives those bytes the values the formats define (NaN, and e5m2's infinities), as
a GPU's conversion does; every other byte converts as before.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from functools import wraps
from typing import Any

import numpy as np

_INSTALLED = "_difftest_skips_nested_patching"
_DECODES = "_difftest_decodes_fp8_specials"


class _Launch:
    """The ``triton.language`` modules (by id) a running launch has patched, and the patch
    scopes of its nested callees (undone before the launch's own)."""

    def __init__(self) -> None:
        self.patched: set[int] = set()
        self.nested: list[Any] = []


def _undoing_nested_first(scope: Any, launch: _Launch) -> None:
    """Make the launch's ``scope.restore`` undo its callees' patches first (last first)."""
    own = scope.restore

    def restore() -> None:
        while launch.nested:
            launch.nested.pop().restore()
        own()

    scope.restore = restore


_launches: list[_Launch] = []


def skip_nested_patching() -> bool:
    """Install the skip into ``triton.runtime.interpreter`` (once); False where this Triton
    lacks the functions it wraps (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope is None:
        return False
    if getattr(patch_lang, _INSTALLED, False):
        return True
    interpreter._patch_lang = _skipping(patch_lang, scope, _language_modules(interpreter))
    executor.__call__ = _tracked(executor.__call__)
    return True


def _language_modules(interpreter: Any) -> Callable[[Callable[..., Any]], set[int]]:
    lang = interpreter.tl

    def modules(fn: Callable[..., Any]) -> set[int]:
        # the modules Triton's _patch_lang patches for fn
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is lang or v is lang.core)}
    return modules


def _skipping(patch_lang: Callable[[Any], Any], scope: type,
              modules: Callable[[Callable[..., Any]], set[int]]) -> Callable[[Any], Any]:
    @wraps(patch_lang)
    def patch(fn: Any) -> Any:
        seen = modules(fn)
        launch = _launches[-1] if _launches else None
        if launch is not None and launch.patched and seen <= launch.patched:
            return scope()  # nothing to patch; the caller never restores a nested scope
        result = patch_lang(fn)
        if launch is not None:
            if launch.patched:
                launch.nested.append(result)
            else:
                _undoing_nested_first(result, launch)
            launch.patched |= seen
        return result

    setattr(patch, _INSTALLED, True)
    return patch


def _tracked(call: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(call)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _launches.append(_Launch())
        try:
            return call(self, *args, **kwargs)
        finally:
            _launches.pop()

    return launch


def skip_dropped_overflow_checks() -> bool:
    """Turn the interpreter's ``sanitize_overflow`` off while its ``debug`` is off (its
    conditions are then built and dropped unchecked); True if the options now skip them."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or options.debug:
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def decode_fp8_specials() -> bool:
    """Wrap the interpreter's float conversion so that fp8 NaN/Inf bytes convert to NaN/Inf
    and float NaN to the fp8 format's NaN byte (once); False where this Triton lacks it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False
    if not getattr(convert, _DECODES, False):
        interpreter._convert_float = _with_fp8_specials(convert, _fp8_specials(interpreter.tl))
    return True


# per fp8 format: its NaN bytes, and its +Inf and -Inf bytes (None: the format has none)
Specials = tuple[tuple[int, ...], tuple[int, int] | None]


def _fp8_specials(tl: Any) -> dict[Any, Specials]:
    return {tl.float8e4nv: ((0x7F, 0xFF), None),  # e4m3fn
            tl.float8e4b8: ((0x80,), None),  # e4m3fnuz
            tl.float8e5: ((*range(0x7D, 0x80), *range(0xFD, 0x100)), (0x7C, 0xFC)),  # e5m2
            tl.float8e5b16: ((0x80,), None)}  # e5m2fnuz


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    return np.frombuffer(values.tobytes(), dtype=getattr(np, f"uint{width}")).reshape(
        values.shape)


def _with_fp8_specials(convert: Callable[..., np.ndarray],
                       specials: dict[Any, Specials]) -> Callable[..., np.ndarray]:
    @wraps(convert)
    def converted(values: np.ndarray, input_dtype: Any, output_dtype: Any,
                  rounding_mode: Any) -> np.ndarray:
        out = convert(values, input_dtype, output_dtype, rounding_mode)
        if input_dtype in specials and output_dtype not in specials:  # fp8 -> wider float
            nan_bytes, infinities = specials[input_dtype]
            width, mantissa = output_dtype.primitive_bitwidth, output_dtype.fp_mantissa_width
            exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
            byte = _bits(values, 8)
            out = out.copy()
            out[np.isin(byte, nan_bytes)] = exponent | (1 << (mantissa - 1))
            if infinities is not None:
                out[byte == infinities[0]] = exponent
                out[byte == infinities[1]] = (1 << (width - 1)) | exponent
        elif output_dtype in specials and input_dtype not in specials:  # wider float -> fp8
            width, mantissa = input_dtype.primitive_bitwidth, input_dtype.fp_mantissa_width
            exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
            bits = _bits(values, width)
            nan = ((bits & exponent) == exponent) & ((bits & ((1 << mantissa) - 1)) != 0)
            out = out.copy()
            out[nan] = specials[output_dtype][0][0]
        return out

    setattr(converted, _DECODES, True)
    return converted
