"""A fake ``aiter`` package backed by the emulator, so vLLM's unmodified AITER path runs.

:func:`installed_as_aiter` registers, for the duration of a ``with`` block, the modules vLLM
imports (``aiter.dtypes``, ``aiter.ops.triton.gluon.pa_decode_gluon``) in ``sys.modules``,
and restores ``sys.modules`` exactly afterwards. :func:`installed_modules` does the same for
any ``pa_decode_gluon`` (``vllm-aiter@compiled`` installs an AITER tree's own launcher).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from difftest.backends.pa_decode_gluon_contract import (
    DEFAULT_ARCH,
    DEFAULT_NUM_CUS,
    DEFAULT_REVISION,
    ContractRevision,
    GluonEmulator,
    make_emulator,
)

_FAKE_MODULES = (
    "aiter",
    "aiter.dtypes",
    "aiter.ops",
    "aiter.ops.triton",
    "aiter.ops.triton.gluon",
    "aiter.ops.triton.gluon.pa_decode_gluon",
)


def _aiter_keys() -> dict[str, types.ModuleType]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "aiter" or name.startswith("aiter.")
    }


@contextlib.contextmanager
def installed_as_aiter(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
    *,
    shadow_real: bool = False,
) -> Iterator[GluonEmulator]:
    """Register fake ``aiter`` modules backed by the emulator for the duration of the block.

    vLLM's unmodified ``_run_gluon_decode`` then imports ``aiter.dtypes`` and
    ``aiter.ops.triton.gluon.pa_decode_gluon`` from them. Every fake module carries
    ``__difftest_emulator__`` = the revision name. Raises ``RuntimeError`` rather than
    shadow a real AITER (already imported or importable) unless ``shadow_real`` is set,
    which a caller running the emulator beside the real kernel in one process must ask for
    explicitly; an emulator is never nested. ``sys.modules`` is restored exactly on exit
    (a real AITER imported before the block included).
    """
    emulator = make_emulator(revision, arch, num_cus)
    with installed_modules(emulator.pa_decode_gluon, emulator.get_recommended_splits,
                           emulator.fp8, emulator.revision.name, "the pa_decode_gluon emulator",
                           shadow_real=shadow_real):
        yield emulator


@contextlib.contextmanager
def installed_modules(
    pa_decode_gluon: Callable[..., Any],
    get_recommended_splits: Callable[..., int],
    fp8: torch.dtype,
    marker: str,
    what: str,
    *,
    shadow_real: bool = False,
) -> Iterator[None]:
    """Register fake ``aiter`` modules whose ``pa_decode_gluon``, ``get_recommended_splits``
    and ``dtypes.fp8`` are the ones given, for the duration of the block; every fake module
    carries ``__difftest_emulator__ = marker``. ``what`` names the stand-in in refusals (see
    :func:`installed_as_aiter`)."""
    present = sys.modules.get("aiter")
    if present is not None and hasattr(present, "__difftest_emulator__"):
        raise RuntimeError(
            f"refusing to install {what}: an emulated 'aiter' module is already imported"
        )
    if present is not None and not shadow_real:
        raise RuntimeError(
            f"refusing to install {what}: a real 'aiter' module is already imported"
        )
    if not shadow_real and importlib.util.find_spec("aiter") is not None:
        raise RuntimeError(
            f"refusing to install {what}: a real 'aiter' package is importable and would be "
            "shadowed"
        )
    saved = _aiter_keys()
    for name in saved:  # no real submodule stays reachable beside the fakes
        del sys.modules[name]
    modules = {name: types.ModuleType(name) for name in _FAKE_MODULES}
    for name, module in modules.items():
        module.__difftest_emulator__ = marker
        if name != _FAKE_MODULES[-1]:
            module.__path__ = []
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    dtypes = modules["aiter.dtypes"]
    dtypes.fp8, dtypes.bf16, dtypes.fp16 = fp8, torch.bfloat16, torch.float16
    dtypes.fp32 = torch.float32
    leaf = modules[_FAKE_MODULES[-1]]
    leaf.pa_decode_gluon = pa_decode_gluon
    leaf.get_recommended_splits = get_recommended_splits
    modules["aiter"].pa_decode_gluon = pa_decode_gluon
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in _aiter_keys():
            del sys.modules[name]
        sys.modules.update(saved)
