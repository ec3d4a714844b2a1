"""Compiling Triton and Gluon kernels in a process whose Triton interprets them.

Under ``TRITON_INTERPRET=1`` (the CPU runtime, :mod:`difftest.machine.devices`) ``@triton.jit``
makes interpreted functions, those of ``triton.language`` included (``tl.max``, ``tl.sum``,
``tl.cdiv`` and their combine functions), and Triton's code generator refuses to compile a
kernel that calls one (``Unsupported function referenced: InterpretedFunction``). Inside
:func:`not_interpreted` the interpreter knob is off, so files executed there get JIT functions,
and every interpreted function an attribute of a ``triton`` module holds is replaced by a JIT
twin of the same Python function and options (made once, so a compiled kernel's record of
the globals it used stays true from call to call); all comes back after the block. A kernel
compiled this way has the machine code a process without the interpreter gives it
(tests/test_aiter_gluon_compiled.py compares them). Nothing interpreted may run inside.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_TWINS: dict[int, tuple[Any, Any]] = {}  # id(interpreted) -> (interpreted, its JIT twin)


def _twin(interpreted: Any) -> Any:
    """The JIT function of ``interpreted``'s Python function and options (made once)."""
    from triton.runtime.jit import JITFunction

    if id(interpreted) not in _TWINS:
        _TWINS[id(interpreted)] = (interpreted, JITFunction(interpreted.fn, **interpreted.kwargs))
    return _TWINS[id(interpreted)][1]


@contextlib.contextmanager
def not_interpreted() -> Iterator[None]:
    """Triton compiles inside the block whatever ``TRITON_INTERPRET`` says (see the module
    docstring); its knobs, the variable and the ``triton`` modules come back after it."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    swapped = []
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        try:
            for name, module in list(sys.modules.items()):
                if module is None or not (name == "triton" or name.startswith("triton.")):
                    continue
                for attr, value in list(vars(module).items()):
                    if isinstance(value, InterpretedFunction):
                        setattr(module, attr, _twin(value))
                        swapped.append((module, attr, value))
            yield
        finally:
            for module, attr, value in swapped:
                setattr(module, attr, value)
