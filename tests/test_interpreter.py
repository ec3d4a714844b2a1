"""The interpreter skips (difftest/machine/interpreter.py): nested re-patching, dropped overflow
checks, and the pure per-op results computed once per argument."""

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


REUSE_SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl
    from difftest.machine.interpreter import (decode_fp8_specials, reuse_pure_results,
                                              reuse_shape_checks)

    @triton.jit
    def kernel(k_ptr, q_ptr, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, D)
        k = tl.load(k_ptr + t[:, None] * D + d[None, :]).to(tl.float32)
        q = tl.load(q_ptr + d).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        tl.store(out_ptr + t, s.to(tl.bfloat16))

    decode_fp8_specials()
    if sys.argv[1] == "reuse":
        assert reuse_pure_results() and reuse_pure_results()  # idempotent
        assert reuse_shape_checks() and reuse_shape_checks()
    k = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    q = (torch.linspace(-2, 2, 16)).to(torch.bfloat16)
    outs = []
    for _ in range(2):  # a second launch reads the shared ranges and tables again
        out = torch.empty(16, dtype=torch.bfloat16)
        kernel[(2,)](k, q, out, BLOCK=8, D=16)
        outs.append(out.view(torch.int16))
    torch.save(torch.stack(outs), sys.argv[2])
''')


def test_reused_results_give_the_same_bits(tmp_path) -> None:
    """An fp8 x bf16 kernel (every e4m3fn byte, NaN included) whose launches convert fp8 and
    bf16, look dtypes up and make ranges: the same bits with the reuse as without."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for mode in ("plain", "reuse"):
        subprocess.run([sys.executable, "-c", REUSE_SCRIPT, mode, str(tmp_path / f"{mode}.pt")],
                       env=env, capture_output=True, text=True, check=True)
    plain, reused = (torch.load(tmp_path / f"{m}.pt") for m in ("plain", "reuse"))
    assert torch.equal(plain, reused)
    assert torch.equal(reused[0], reused[1])


def test_each_table_equals_the_conversion_it_replaces() -> None:
    """Every fp8 and 16-bit float format to every other, both rounding modes, on random
    codes in a strided view: the table's values are the conversion's, dtype and shape too
    (and a pair the conversion cannot do raises as it does)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("triton")
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    from difftest.machine.interpreter import _tabulated, decode_fp8_specials

    decode_fp8_specials()
    tl = interpreter.tl
    convert = interpreter._convert_float
    while getattr(convert, "_difftest_reuses_pure_results", False):
        convert = convert.__wrapped__
    tabulated = _tabulated(convert)
    narrow = [tl.float8e4nv, tl.float8e4b8, tl.float8e5, tl.float8e5b16, tl.bfloat16,
              tl.float16]
    rng = np.random.default_rng(7)
    compared = set()
    for source in narrow:
        width = source.primitive_bitwidth
        codes = rng.integers(0, 1 << width, size=(24, 10), dtype=getattr(np, f"uint{width}"))
        values = codes[::2, 1:8]  # not contiguous
        for target in [*narrow, tl.float32]:
            if target is source:
                continue
            for mode in (ir.ROUNDING_MODE.RTNE, ir.ROUNDING_MODE.RTZ):
                try:
                    want = convert(values, source, target, mode)
                except (OverflowError, ValueError) as refused:  # a pair it cannot convert
                    with pytest.raises(type(refused)):
                        tabulated(values, source, target, mode)
                    continue
                got = tabulated(values, source, target, mode)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got, want), (source, target, mode)
                compared.add((source.name, target.name))
    # every upcast of fp8 and to float32, and the 16-bit formats' downcasts to fp8
    assert {(s.name, "fp32") for s in narrow} <= compared
    assert {("fp16", t.name) for t in narrow[:4]} <= compared


def test_shared_ranges_and_dtypes() -> None:
    """A range is made once and cannot be written; dtype lookups are the lookup's."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    from difftest.machine.interpreter import reuse_pure_results

    assert reuse_pure_results()
    builder = interpreter.InterpreterBuilder
    first = builder.create_make_range(None, None, 4, 12).data
    assert first is builder.create_make_range(None, None, 4, 12).data
    assert np.array_equal(first, np.arange(4, 12, dtype=np.int32)) and first.dtype == np.int32
    with pytest.raises(ValueError):
        first[0] = 1
    tl = interpreter.tl
    lookup = interpreter._get_np_dtype
    for tt in (tl.float32, tl.bfloat16, tl.int1, tl.float8e4nv, tl.pointer_type(tl.float16)):
        assert lookup(tt) == lookup.__wrapped__(tt)


def test_reused_shapes_equal_the_constructors() -> None:
    """A block type and a tensor built with the shapes reused hold what Triton's own
    constructors give (shape values and type, element count, name, dtype), built twice
    (the second from what the first kept); shapes Triton refuses raise as it does."""
    pytest.importorskip("triton")
    import triton.language.core as core

    from difftest.machine.interpreter import reuse_shape_checks

    assert reuse_shape_checks() and reuse_shape_checks()  # idempotent
    block_init, tensor_init = core.block_type.__init__, core.tensor.__init__

    def built(cls, init, *args):
        made = object.__new__(cls)
        init(made, *args)
        return made

    for shape in ([16], [1, 64], core.tuple([8, 1, 32]), [2, 4]):
        for _ in range(2):
            want = built(core.block_type, block_init.__wrapped__, core.float16, shape)
            got = built(core.block_type, block_init, core.float16, shape)
            assert type(got.shape) is type(want.shape)
            assert got.shape.values == want.shape.values and got.numel == want.numel
            assert got.shape.type == want.shape.type and got.name == want.name
            assert got == want
            t_want = built(core.tensor, tensor_init.__wrapped__, "h", want)
            t_got = built(core.tensor, tensor_init, "h", got)
            assert [d.value for d in t_got.shape] == [d.value for d in t_want.shape]
            assert t_got.shape.type == t_want.shape.type and t_got.numel == t_want.numel
            assert t_got.dtype is t_want.dtype and t_got.handle == "h"
    scalar = built(core.tensor, tensor_init, "s", core.int32)
    assert scalar.shape.values == [] and scalar.numel.value == 1
    for bad in ([], [3], [4, 6], [4.0]):
        raised = []
        for init in (block_init.__wrapped__, block_init, block_init):
            with pytest.raises((TypeError, ValueError)) as error:
                built(core.block_type, init, core.float16, bad)
            raised.append((error.type, str(error.value)))
        assert raised[0] == raised[1] == raised[2]
