"""What a backend states about the kernel call it made: every parameter, the class of the
value it passed, and why a parameter never varies.

A backend builds the keyword arguments of its kernel call, calls the kernel with them, and
states the call from the same mapping with :func:`kernel_call` (through
:meth:`difftest.contract.backend.RunInputs.state`), so the statement cannot drift from the call. The
statement walks the kernel's own signature: a parameter the backend did not pass is stated
with its default. :mod:`difftest.judgement.audit` collects the statements over a run and renders
them; it knows no backend.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from difftest.primitives.dtypes import dtype_name

PAGE_ID_16_BITS = 1 << 16


@dataclass(frozen=True)
class StatedArgument:
    """One parameter of a call: ``label`` classes the value passed (``default ...`` where
    none was); ``fixed`` says why it never varies (empty: it should vary over cases);
    ``shape`` says where a size the kernel reads from its tensors sits."""

    label: str
    fixed: str = ""
    shape: str = ""


@dataclass(frozen=True)
class DeviceCode:
    """One GPU kernel a call compiled, for one arch: what the gate compares between reports.

    ``specialization`` is the text key of what determines the binary (the constexprs, and each
    other argument's type and divisibility); ``sha256`` hashes the machine code (the code
    object's ``.text``); ``vgprs``/``sgprs`` and ``spills`` (VGPRs spilled to scratch plus
    SGPRs spilled to VGPR lanes) come from the code object's metadata, ``lds_bytes`` is the
    workgroup's shared memory, ``occupancy`` the waves per SIMD registers and LDS allow."""

    kernel: str
    arch: str
    specialization: str
    sha256: str
    vgprs: int
    sgprs: int
    lds_bytes: int
    spills: int
    occupancy: int


@dataclass(frozen=True)
class KernelCall:
    """The statement of one kernel call: the kernel's name and its parameters, in order;
    ``device_code``: the GPU kernels it compiled, where a backend compiles them for an arch
    instead of running them (``aiter-gluon@compiled``)."""

    kernel: str
    arguments: dict[str, StatedArgument] = field(default_factory=dict)
    device_code: list[DeviceCode] = field(default_factory=list)

    READ_OPTIONAL: ClassVar[frozenset[str]] = frozenset({"device_code"})  # reports before it


def kernel_name(kernel: Callable[..., Any]) -> str:
    """The name of a Python or Triton (``JITFunction.fn``) kernel."""
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


def kernel_call(
    kernel: Callable[..., Any],
    passed: Mapping[str, Any],
    labels: Mapping[str, str] | None = None,
    fixed: Mapping[str, str] | None = None,
    sizes: Mapping[str, tuple[int, str]] | None = None,
) -> KernelCall:
    """The statement of ``kernel(**passed)``.

    Every parameter of the kernel's signature, in order: ``labels[name]`` where the backend
    classes the value itself, else :func:`label` of the passed value, else ``default <value>``;
    ``fixed[name]`` is the reason it never varies. ``sizes`` (name -> (value, where in the
    shapes)) adds the sizes the kernel reads from its tensors' shapes, fixed where ``fixed``
    names them (reasons for parameters a release's signature lacks are not stated). A passed
    name the signature lacks is a ``ValueError``: the statement would describe another call.
    """
    labels, fixed, sizes = labels or {}, fixed or {}, sizes or {}
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    named = [p for p in params.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_more = any(p.kind is p.VAR_KEYWORD for p in params.values())
    name = kernel_name(kernel)
    known = {p.name for p in named} | set(sizes)
    stray = sorted(set(passed) - known) if not takes_more else []
    if stray:
        raise ValueError(f"{name}: passed argument {stray[0]!r} is not a parameter "
                         f"(parameters: {', '.join(p.name for p in named)})")
    arguments: dict[str, StatedArgument] = {}
    extra = [n for n in passed if n not in params] if takes_more else []
    for param in [p.name for p in named] + extra:
        if param in labels:
            text = labels[param]
        elif param in passed:
            text = label(passed[param])
        elif params[param].default is not inspect.Parameter.empty:
            text = f"default {label(params[param].default)}"
        else:
            text = "not passed"
        arguments[param] = StatedArgument(text, fixed.get(param, ""))
    for size, (value, where) in sizes.items():
        arguments[size] = StatedArgument(str(value), fixed.get(size, ""), where)
    return KernelCall(name, arguments)


def label(value: Any) -> str:
    """A value's class: tensors by dtype and shape past the leading dim (0-d ones by
    :func:`scale_class`), numbers as written, dtypes and enums by name."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.numel() == 1:
            return f"{dtype_name(value.dtype)} {scale_class(float(value.flatten()[0]))}"
        inner = ", ".join(str(n) for n in value.shape[1:])
        return f"{dtype_name(value.dtype)} [N, {inner}]" if inner else \
            f"{dtype_name(value.dtype)} [N]"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def scale_class(value: float | None) -> str:
    """``None``, ``1.0``, ``< 1`` or ``> 1``: the classes of a dequantisation scale."""
    if value is None:
        return "None"
    return "1.0" if value == 1.0 else ("< 1" if value < 1 else "> 1")


def length_classes(lengths: Iterable[int], block: int = 128, span: int = 16 * 128) -> str:
    """Boundary classes of token counts: 0, exact blocks, a 1 or ``block - 1`` tail, another
    tail, past ``span`` (MiniMax-M3's top-k 16 blocks of 128 tokens)."""
    out = set()
    for n in lengths:
        if n == 0:
            out.add("0")
        elif n % block == 0:
            out.add(f"multiple of {block}")
        elif n % block in (1, block - 1):
            out.add(f"tail {n % block}")
        else:
            out.add("other tail")
        if n > span:
            out.add(f"> {span}")
    return "{" + ", ".join(sorted(out)) + "}"


def id_classes(ids: torch.Tensor, last: int, valid: torch.Tensor | None = None) -> str:
    """Which boundaries a table of page or block ids reaches: ``width`` (its columns), id 0,
    the ``last`` valid id, ids past 2**16; ``valid`` masks the entries a kernel reads."""
    read = ids if valid is None else ids[valid]
    out = {f"width {ids.shape[-1]}"}
    if read.numel():
        low, high = int(read.min()), int(read.max())
        if low == 0:
            out.add("id 0")
        if high == last:
            out.add("last id")
        if high >= PAGE_ID_16_BITS:
            out.add("id >= 2**16")
    return "{" + ", ".join(sorted(out)) + "}"
