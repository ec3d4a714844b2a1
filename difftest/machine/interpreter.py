"""Triton's interpreter for CPU runs (``TRITON_INTERPRET=1``): faster, and fp8 as a GPU has it.

:func:`skip_nested_patching` skips the interpreter's re-patching of ``triton.language`` on
nested ``@jit`` calls inside a launch and undoes a nested callee's patches with the launch's
(finding F33); :func:`skip_dropped_overflow_checks` skips the overflow conditions it builds
and drops while ``debug`` is off (F20); :func:`decode_fp8_specials` converts fp8 NaN/Inf
bytes as the formats define them and rounds to fp8 as a GPU does (F27, F38);
:func:`reuse_pure_results` computes three pure per-op functions once per argument;
:func:`reuse_shape_checks` builds a tensor's and a block type's shape once per shape. Each
runs the same functions on the same values (tests/test_interpreter.py); why that holds and
what each saves, measured: docs/performance.md ("The interpreter").
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from functools import wraps
from typing import Any

import numpy as np

_INSTALLED = "_difftest_skips_nested_patching"
_DECODES = "_difftest_decodes_fp8_specials"
_REUSES = "_difftest_reuses_pure_results"
_SHAPES = "_difftest_reuses_shape_checks"
TABLE_BITS = 16  # conversions from floats this narrow go through a table of every code


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
    found: dict[int, tuple[dict[str, Any], int, set[int]]] = {}

    def modules(fn: Callable[..., Any]) -> set[int]:
        # the modules Triton's _patch_lang patches for fn, found again only when fn's
        # module gained or lost names since (a kernel module's names are set at import)
        names = fn.__globals__
        known = found.get(id(names))
        if known is not None and known[0] is names and known[1] == len(names):
            return known[2]
        seen = {id(v) for v in names.values()
                if inspect.ismodule(v) and (v is lang or v is lang.core)}
        found[id(names)] = (names, len(names), seen)
        return seen
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
            rounded = _rounded_to_fp8(values, input_dtype, output_dtype, rounding_mode)
            if rounded is not None:
                out = rounded
            width, mantissa = input_dtype.primitive_bitwidth, input_dtype.fp_mantissa_width
            exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
            bits = _bits(values, width)
            nan = ((bits & exponent) == exponent) & ((bits & ((1 << mantissa) - 1)) != 0)
            out = out.copy()
            out[nan] = specials[output_dtype][0][0]
        return out

    setattr(converted, _DECODES, True)
    return converted


def reuse_pure_results() -> bool:
    """Compute the interpreter's numpy dtype lookup, narrow float conversions and ranges
    once per argument (once; after :func:`decode_fp8_specials`, whose conversion the tables
    hold); False where this Triton lacks one of them (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    dtype_of = getattr(interpreter, "_get_np_dtype", None)
    convert = getattr(interpreter, "_convert_float", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if dtype_of is None or convert is None or handle is None or not hasattr(
            builder, "create_make_range"):
        return False
    if not getattr(dtype_of, _REUSES, False):
        interpreter._get_np_dtype = _memoized_dtypes(dtype_of)
    if not getattr(convert, _REUSES, False):
        interpreter._convert_float = _tabulated(convert)
    if not getattr(builder.create_make_range, _REUSES, False):
        builder.create_make_range = _shared_ranges(handle, interpreter.tl.int32)
    return True


def _memoized_dtypes(dtype_of: Callable[[Any], np.dtype]) -> Callable[[Any], np.dtype]:
    found: dict[Any, np.dtype] = {}

    @wraps(dtype_of)
    def memoized(tt_dtype: Any) -> np.dtype:
        try:
            return found[tt_dtype]
        except KeyError:
            found[tt_dtype] = result = dtype_of(tt_dtype)
            return result
        except TypeError:  # an unhashable type (pointer types define no hash)
            return dtype_of(tt_dtype)

    setattr(memoized, _REUSES, True)
    return memoized


def _tabulated(convert: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    tables: dict[tuple[Any, Any, Any], np.ndarray] = {}

    @wraps(convert)
    def converted(values: np.ndarray, input_dtype: Any, output_dtype: Any,
                  rounding_mode: Any) -> np.ndarray:
        width = input_dtype.primitive_bitwidth
        if width > TABLE_BITS:
            return convert(values, input_dtype, output_dtype, rounding_mode)
        codes = getattr(np, f"uint{width}")
        key = (input_dtype, output_dtype, rounding_mode)
        table = tables.get(key)
        if table is None:  # the conversion is elementwise: each code's result, once
            table = convert(np.arange(1 << width, dtype=codes), input_dtype, output_dtype,
                            rounding_mode)
            tables[key] = table
        return table[np.frombuffer(values.tobytes(), dtype=codes)].reshape(values.shape)

    setattr(converted, _REUSES, True)
    return converted


def _shared_ranges(handle: Any, int32: Any) -> Callable[..., Any]:
    ranges: dict[tuple[int, int], np.ndarray] = {}

    def create_make_range(self: Any, ret_ty: Any, start: int, stop: int) -> Any:
        data = ranges.get((start, stop))
        if data is None:
            data = np.arange(start, stop, dtype=np.int32)
            data.setflags(write=False)
            ranges[(start, stop)] = data
        return handle(data, int32)

    setattr(create_make_range, _REUSES, True)
    return create_make_range


def reuse_shape_checks() -> bool:
    """Build each shape's checked form once: a block type's shape, its checked element
    count and its tuple type, and a tensor's shape as constexprs with its element count, the
    same values the constructors compute for every op of every program (once; False where
    this Triton's constructors set other attributes, then nothing changes)."""
    try:
        import triton.language.core as core
    except ImportError:
        return False
    tensor, block_type = core.tensor, core.block_type
    if getattr(tensor.__init__, _SHAPES, False):
        return True
    made_block = block_type(core.int32, [2, 4])
    made_tensor = tensor(None, made_block)
    if (set(vars(made_block)) != {"element_ty", "shape", "numel", "name"}
            or set(vars(made_tensor)) != {"handle", "shape", "numel", "type", "dtype"}):
        return False
    block_type.__init__ = _block_shapes_once(block_type.__init__, core)
    tensor.__init__ = _tensor_shapes_once(tensor.__init__, core)
    return True


def _block_shapes_once(original: Callable[..., None], core: Any) -> Callable[..., None]:
    found: dict[tuple[int, ...], tuple[list[int], int, Any]] = {}
    lists, ints = (list, core.tuple), {int}

    @wraps(original)
    def __init__(self: Any, element_ty: Any, shape: Any) -> None:
        key = tuple(shape) if type(shape) in lists and set(map(type, shape)) <= ints else None
        known = found.get(key) if key is not None else None
        if known is None:  # checked (and raising) as Triton checks it
            original(self, element_ty, shape)
            if key is not None:
                found[key] = (list(self.shape.values), self.numel, self.shape.type)
            return
        values, numel, shape_type = known
        self.element_ty = element_ty
        self.shape = core.tuple(list(values), shape_type)
        self.numel = numel
        self.name = f"<{self.shape}, {self.element_ty}>"

    setattr(__init__, _SHAPES, True)
    return __init__


def _tensor_shapes_once(original: Callable[..., None], core: Any) -> Callable[..., None]:
    found: dict[tuple[int, ...], tuple[Any, list[Any], Any]] = {}

    @wraps(original)
    def __init__(self: Any, handle: Any, type: Any) -> None:
        key = tuple(type.shape) if type.is_block() else ()
        known = found.get(key)
        if known is None:
            dims = [core.constexpr(d) for d in key]
            known = found[key] = (core.constexpr(math.prod(key)), dims, core.tuple(dims).type)
        numel, dims, shape_type = known
        self.handle = handle
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = core.tuple(list(dims), shape_type)

    setattr(__init__, _SHAPES, True)
    return __init__


def _rounded_to_fp8(values: np.ndarray, input_dtype: Any, output_dtype: Any,
                    rounding_mode: Any) -> np.ndarray | None:
    """The fp8 bytes of float32/float16/bfloat16 ``values`` rounded to nearest even and
    saturated at the format's finite maximum, as a GPU's conversion (``cvt.rn.satfinite``)
    gives them; ``None`` for a rounding toward zero or a format torch lacks (the
    interpreter's own conversion then stands). The interpreter's adds the rounding bit
    without its carry into the exponent (e4m3fn: 31.67 -> 16) and truncates subnormals
    (1e-3 -> 0): finding F38."""
    import torch
    from triton._C.libtriton import ir

    if rounding_mode not in (None, ir.ROUNDING_MODE.RTNE):
        return None
    formats = {"fp8e4nv": torch.float8_e4m3fn, "fp8e4b8": torch.float8_e4m3fnuz,
               "fp8e5": torch.float8_e5m2, "fp8e5b16": torch.float8_e5m2fnuz}
    sources = {"fp32": (np.float32, torch.float32), "fp16": (np.float16, torch.float16),
               "bf16": (np.int16, torch.bfloat16)}
    target, source = formats.get(output_dtype.name), sources.get(input_dtype.name)
    if target is None or source is None:
        return None
    wide = torch.from_numpy(np.ascontiguousarray(values).view(source[0]).copy())
    wide = wide.view(source[1]).to(torch.float32)
    limit = float(torch.finfo(target).max)
    stored = torch.where(wide.isnan(), wide, wide.clamp(-limit, limit)).to(target)
    return stored.view(torch.uint8).numpy().reshape(values.shape)
