"""What a backend states so that a script outside difftest can make its kernel call again.

``difftest export`` (:mod:`difftest.run.export`) turns a failure into a script that needs only
torch and the kernel's own package. The backend knows how its kernel is reached and with
which values it is called, so it states both, as it states the call's audit record
(:mod:`difftest.contract.kernel_call`): just before the call, from the same keyword arguments,
through :meth:`difftest.contract.backend.RunInputs.export_call`, which keeps them only while
an export asks for them. A backend that states nothing cannot be exported (the export says
so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelImport:
    """How a script gets the kernel: ``loader(tree, device, **options)`` returns it.

    ``loader`` is self-contained (the script holds a copy of its source: it imports only the
    standard library, torch, Triton and the kernel's package inside its body); ``tree`` is a
    directory the script's user may give (``--tree``: a release or a source tree), ``None``
    for the installed package; ``device`` is ``"cpu"`` (Triton's interpreter) or ``"cuda"``.
    ``package`` names what a maintainer installs (``vllm``, ``amd-aiter``); ``recorded_tree``
    is where the recorded run loaded it from (stated in the script, ``""`` for the installed
    package); ``options`` are literal keyword arguments of ``loader``.
    """

    package: str
    loader: Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=dict)
    recorded_tree: str = ""


@dataclass(frozen=True)
class ExportedCall:
    """One kernel call by value: ``kernel(**arguments)``, or ``kernel[grid](**arguments)``
    for a Triton launch; ``output`` names the argument the kernel writes its output into
    (``None``: the call returns it)."""

    source: KernelImport
    kernel: str
    arguments: Mapping[str, Any]
    grid: tuple[int, ...] | None = None
    output: str | None = None
