"""The interpreter skips (difftest/machine/interpreter.py): nested re-patching, dropped overflow
checks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl
    from triton.runtime import interpreter

    calls = []
    original = interpreter._patch_lang
    def counted(fn):
        calls.append(fn.__name__)
        return original(fn)
    interpreter._patch_lang = counted
    if sys.argv[1] == "skip":
        from difftest.machine.interpreter import skip_nested_patching
        assert skip_nested_patching() and skip_nested_patching()  # idempotent

    @triton.jit
    def scaled(x, s):
        return x * s + tl.sqrt(tl.abs(x))

    @triton.jit
    def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(3):
            acc += scaled(x, i + 1.5)
        tl.store(out_ptr + offs, tl.exp(acc * 0.01), mask=mask)

    x = torch.linspace(-3, 5, 1000)
    out = torch.empty_like(x)
    kernel[(8,)](x, out, 1000, BLOCK=128)
    kernel[(8,)](x, out, 1000, BLOCK=128)  # a second launch after the first one's restore
    torch.save(out, sys.argv[2])
    leaked = [name for name, value in vars(tl.core).items()
              if "_patch_attr" in getattr(value, "__qualname__", "")]
    print(len(calls), len(leaked))
''')


def _run(mode: str, path: str) -> tuple[int, int]:
    """The script's patch count and the interpreter patches left on ``triton.language.core``
    after its launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, path], env=env,
                          capture_output=True, text=True, check=True)
    patches, leaked = done.stdout.split()[-2:]
    return int(patches), int(leaked)


def test_the_skip_runs_the_same_kernels_with_fewer_patches(tmp_path) -> None:
    """Two launches of a kernel calling a helper 3 times in each of its 8 programs: the same
    bits, and the nested patches are gone: each launch patches once for itself and once for
    the first callee that sees ``triton.language.core`` (a ``triton.language`` function
    written in Triton), which the kernel's own patch does not cover. That callee's patches
    are undone with the launch's, where Triton leaves them on ``triton.language.core`` (a
    kernel compiled later in the process would meet them)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    plain, plain_leaked = _run("plain", str(tmp_path / "plain.pt"))
    skipped, skipped_leaked = _run("skip", str(tmp_path / "skip.pt"))
    assert plain >= 2 * (1 + 3 * 8)
    assert skipped == 2 * 2
    assert plain_leaked > 0
    assert skipped_leaked == 0
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "skip.pt")
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


OVERFLOW_SCRIPT = textwrap.dedent('''
    import dataclasses, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl
    from triton.runtime import interpreter
    from difftest.machine.interpreter import skip_dropped_overflow_checks

    @triton.jit
    def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * 3 + offs - 7, mask=mask)  # int32: wraps past 2**31

    x = torch.tensor([2**31 - 1, -2**31, 5, 2**30, -(2**30) - 3], dtype=torch.int32)
    builder = interpreter.interpreter_builder
    default = builder.options

    def launch():
        out = torch.empty_like(x)
        try:
            kernel[(1,)](x, out, x.numel(), BLOCK=8)
        except Exception as error:
            return "raised" if "overflow detected" in str(error) else repr(error)
        return out.tolist()

    results = {"default": launch()}
    builder.options = dataclasses.replace(default, debug=True)
    results["debug"] = launch()
    results["skip under debug"] = [skip_dropped_overflow_checks(), launch()]
    builder.options = default
    results["skip"] = [skip_dropped_overflow_checks(), builder.options.sanitize_overflow,
                       launch()]
    print(results)
''')


def test_the_dropped_overflow_checks_are_skipped_and_debug_keeps_them() -> None:
    """An int32 kernel that overflows: with the interpreter's default options (``debug``
    off) nothing raises and the values wrap, as on a GPU; under ``debug`` the sanitizer
    raises. :func:`skip_dropped_overflow_checks` changes neither: it refuses under
    ``debug`` (the check still raises) and, off, gives the same wrapped values."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT], env=env,
                          capture_output=True, text=True, check=True)
    results = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    mask = 2**32
    wrapped = [((v * 3 + i - 7 + 2**31) % mask) - 2**31
               for i, v in enumerate([2**31 - 1, -2**31, 5, 2**30, -(2**30) - 3])]
    assert results["default"] == wrapped
    assert results["debug"] == "raised"
    assert results["skip under debug"] == [False, "raised"]
    assert results["skip"] == [True, False, wrapped]
