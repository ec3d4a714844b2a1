"""The framework's Triton kernels compile once per dtype and mode set, whatever the case shape.

On a GPU a ``@triton.jit`` kernel is compiled for every new specialization key
(:func:`difftest.machine.kernel_compiles.specialization_key`: argument types, constexprs, and
the divisibility by 16 of integers and pointers not excluded). Under the interpreter nothing is
compiled, so these tests compute the key each launch would have on a GPU and count them over
cases of many shapes (rows, heads, segments per row, attended blocks, cache sizes): the
reference's two kernels (difftest/backends/_reference_triton.py), the cache builder
(difftest/inputs/_kv_cache_triton.py) and the counter RNG
(difftest/primitives/_counter_rng_triton.py) each get one key per dtype and mode set, the
read-only digest's (difftest/primitives/_word_sums_triton.py) one per width.
Before sizes were unspecialized run-time arguments and the table pointers (views into one
packed buffer, at any offset) lost their alignment specialization, 25 generated cases gave
the reference 14 and 10 keys for 5 and 3 mode sets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from difftest.backends import torch_ref
from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.generation.dense import dense_cases
from difftest.generation.generate import generated_cases
from difftest.generation.strategies import cases
from difftest.inputs.kv_cache import CachePool
from difftest.machine import devices
from difftest.machine.kernel_compiles import (
    KernelCompiles,
    describe,
    merged,
    specialization_key,
    use_kernel_cache,
)

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(
    not devices.interpreted(), reason="Triton kernels run on CPU tensors only under "
                                      "TRITON_INTERPRET=1 (set by the CPU runtime)")


@triton.jit(do_not_specialize=["unlisted"], do_not_specialize_on_alignment=["table_ptr"])
def _toy_kernel(out_ptr, table_ptr, n, unlisted, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(table_ptr + i) + n + unlisted, mask=i < n)


@contextmanager
def launched_keys() -> Iterator[list[tuple[str, str]]]:
    """Every interpreted launch's ``(kernel name, specialization key)``, in order."""
    from triton.runtime import interpreter

    keys: list[tuple[str, str]] = []
    run = interpreter.InterpretedFunction.run

    def noting(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        keys.append((self.fn.__name__, specialization_key(self, args, kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = noting
    try:
        yield keys
    finally:
        interpreter.InterpretedFunction.run = run


def small_cases() -> list[Case]:
    """Sparse and dense cases of many shapes, small enough to interpret quickly (at most 24
    row, KV head and segment triples: the reference kernels' programs)."""
    found = [*generated_cases(40, 3, cases, max_batch=3, max_topk=4, max_blocks=96),
             *generated_cases(16, 3, dense_cases)]
    return [c for c in found if c.total_q * c.num_kv_heads * len(c.selections[0]) <= 24]


def keys_by_mode(mode_of: Callable[[Case], Any], run: Callable[[Case], None],
                 chosen: list[Case]) -> dict[str, dict[Any, set[str]]]:
    """Per kernel, per mode set of the cases that launched it, the keys its launches had."""
    found: dict[str, dict[Any, set[str]]] = defaultdict(lambda: defaultdict(set))
    for case in chosen:
        with launched_keys() as keys:
            run(case)
        for name, key in keys:
            found[name][mode_of(case)].add(key)
    return found


def assert_one_key_per_mode(found: dict[str, dict[Any, set[str]]], kernels: set[str],
                            chosen: list[Case]) -> None:
    assert set(found) == kernels
    for name, modes in found.items():
        several = {mode: len(keys) for mode, keys in modes.items() if len(keys) > 1}
        assert not several, f"{name}: mode sets compiled more than once: {several}"
        # distinct modes are distinct binaries, and the shapes really varied
        assert len(set().union(*modes.values())) == len(modes)
    shapes = {(c.total_q, c.num_q_heads, c.num_blocks, len(c.selections[0])) for c in chosen}
    assert len(shapes) >= 2 * max(len(m) for m in found.values())


def stored_format(case: Case) -> str:
    """How the reference's kernels read a stored block (fp8 words, or float32 copies)."""
    return case.kv_dtype if case.kv_dtype.startswith("float8") else "float32"


def reference_reads_with_kernels(case: Case) -> bool:
    """The geometries the reference's kernels cover (powers of two; others run in torch)."""
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return (pow2(case.block_size) and case.block_size >= 16 and pow2(case.head_dim)
            and case.head_dim >= 32)


@needs_interpreter
def test_the_reference_kernels_compile_once_per_dtype_and_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = [c for c in small_cases() if reference_reads_with_kernels(c)]
    monkeypatch.setattr(torch_ref, "_triton_reads", lambda k_stored: True)

    def mode(case: Case) -> tuple[object, ...]:
        # a window is run-time data (each segment's first attended token), not a mode
        return (stored_format(case), case.block_size, case.head_dim)

    found = keys_by_mode(mode, lambda c: TorchReference().reference(RunInputs(c, CPU)),
                         chosen)
    assert_one_key_per_mode(found, {"_scores_kernel", "_values_kernel"}, chosen)
    assert any(c.sliding_window for c in chosen) and not all(c.sliding_window for c in chosen)


@needs_interpreter
def test_the_cache_builder_compiles_once_per_dtype_and_mode() -> None:
    """One key per element size, in-page order, canary mode and side, over cases whose
    attended blocks, cache sizes and layouts vary (a pool kept across them, as a session)."""
    chosen = [c for c in small_cases() if c.layout.fused_writer]
    pool = CachePool(triton=True)

    def build(case: Case) -> None:
        inputs = RunInputs(case, CPU, pool=pool)
        for order in case.layout.in_page_orders:
            inputs.cache(order)

    def mode(case: Case) -> tuple[object, ...]:
        return (torch.finfo(getattr(torch, case.kv_dtype)).bits, case.canary,
                case.layout.in_page_orders, case.block_size, case.head_dim, case.num_kv_heads)

    found = keys_by_mode(mode, build, chosen)
    assert set(found) == {"_attended_side_kernel"}
    # each mode set launches both sides in each of its orders: 2 keys per order
    for modes in found.values():
        for (_, _, orders, *_), keys in modes.items():
            assert len(keys) == 2 * len(orders), keys
    assert len({c.num_blocks for c in chosen}) >= 3


@needs_interpreter
def test_the_counter_rng_kernel_compiles_once_per_dtype_and_mode() -> None:
    """The generation kernel's keys over row tensors at any offset and the row lengths cases
    have (``Hq * D`` for queries, ``B * Hkv * D`` for blocks: multiples of 16, so the length
    keeps the divisibility that lets a GPU vectorise the stores)."""
    from difftest.primitives import _counter_rng_triton as kernels

    packed = torch.arange(40, dtype=torch.int64)
    row_sets = [packed[:3], packed[5:7], packed[7:8], torch.tensor([1, 30])]
    lengths = [16 * 64, 3 * 80, 16 * 2 * 96, 2 * 256]
    keys: dict[tuple[str, bool], set[str]] = defaultdict(set)
    with launched_keys() as launched:
        for rows, length, seed in zip(row_sets, lengths, (0, 2**31 + 5, 7, 2**32 - 1),
                                      strict=True):
            kernels.normal_rows_triton(seed, rows, length)
            keys["float32", False].add(launched[-1][1])
            kernels.stored_normal_rows_triton(seed, rows, length, torch.float16, 0.5, 448.0)
            keys["float16", True].add(launched[-1][1])
    assert {mode: len(k) for mode, k in keys.items()} == {("float32", False): 1,
                                                            ("float16", True): 1}


@needs_interpreter
def test_the_digest_kernel_compiles_once_per_width() -> None:
    """The read-only digest's kernel over grids of any row count, at any offset of a
    buffer (the caches' and the inputs' words): one key for the digest's width."""
    from difftest.primitives import _word_sums_triton as kernels

    words = torch.arange(64 * 40 + 3, dtype=torch.int64)
    grids = [words[:64].view(-1, 16), words[3:3 + 16 * 9].view(-1, 16),
             words[16:16 * 40].view(-1, 16), words[5:21].view(-1, 16)]
    with launched_keys() as launched:
        for grid in grids:
            kernels.word_sums(grid)
    assert len({key for _, key in launched}) == 1 and len(launched) == len(grids)


@needs_interpreter
def test_the_key_is_the_compiled_jits() -> None:
    """Integers and pointers are specialized on divisibility by 16 (an integer 1 on its
    value) unless listed; constexprs and types always."""
    table = torch.arange(64, dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32)

    def key(*args: Any, block: int = 16) -> str:
        return specialization_key(_toy_kernel, args, {"BLOCK": block})

    base = key(out, table, 32, 7)
    assert key(out, table, 48, 9) == base  # n divisible by 16 both times; unlisted not keyed
    assert key(out, table, 33, 7) != base
    assert key(out, table, 1, 7) != key(out, table, 33, 7)  # 1 is a constant
    assert key(out, table[1:], 32, 7) == base  # the table's alignment is not keyed
    assert key(out[1:], table, 32, 7) != base  # out's is
    assert key(out, table.long(), 32, 7) != base
    assert key(out, table, 32, 7, block=32) != base
    assert key(out, table, 2**33, 7) != base  # int64


@needs_interpreter
def test_compiles_are_counted_by_stage() -> None:
    """Interpreted launches count the specializations a GPU would compile, in the stage that
    first launched each; Triton's compilation listener counts compiles and cache loads."""
    from triton import knobs
    from triton.knobs import CompileTimes

    table = torch.arange(64, dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32)
    compiles = KernelCompiles().start()
    try:
        _toy_kernel[(1,)](out, table, 32, 0, BLOCK=16)
        with compiles.stage("kernel-a"):
            _toy_kernel[(1,)](out, table, 48, 0, BLOCK=16)  # the same key: not counted
            _toy_kernel[(1,)](out, table, 33, 0, BLOCK=16)
            times = CompileTimes(ir_initialization=500_000, lowering_stages=[("ptx", 1_000_000)],
                                 store_results=500_000)
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=times,
                                       cache_hit=False)
            knobs.compilation.listener(src=None, metadata={}, metadata_group={},
                                       times=CompileTimes(250_000, [], 0), cache_hit=True)
    finally:
        compiles.stop()
    _toy_kernel[(1,)](out, table, 3, 0, BLOCK=16)  # stopped: not counted
    summary = compiles.to_dict()
    assert summary["framework"]["interpreted"] == 1
    assert summary["kernel-a"] == {"compiled": 1, "compile_seconds": 2.0, "loaded": 1,
                                   "load_seconds": 0.25, "interpreted": 1}
    assert describe(summary, "/cache").startswith(
        "kernels: 1 specializations compiled in 2.0 s (kernel-a 1 in 2.0 s); 1 loaded from "
        "the kernel cache (/cache) in 0.2 s; 2 more interpreted")
    interpreted = {"framework": {"interpreted": 2}, "kernel-a": {"interpreted": 3}}
    assert describe(merged([interpreted, interpreted])) == (
        "kernels: interpreted (TRITON_INTERPRET=1), none compiled; a GPU would compile 10 "
        "specializations (framework 4, kernel-a 6)")


def test_the_kernel_cache_is_one_setting() -> None:
    """DIFFTEST_KERNEL_CACHE sets Triton's TRITON_CACHE_DIR; without either, Triton's default."""
    env = {"DIFFTEST_KERNEL_CACHE": "/ci/kernels", "TRITON_CACHE_DIR": "/elsewhere"}
    assert use_kernel_cache(env) == "/ci/kernels" == env["TRITON_CACHE_DIR"]
    assert use_kernel_cache({"TRITON_CACHE_DIR": "/t"}) == "/t"
    assert use_kernel_cache({"TRITON_HOME": "/h"}) == "/h/.triton/cache"


COPYING_PLUGIN = '''
import torch, triton, triton.language as tl
from difftest.backends.torch_ref import TorchReference


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


class Copied(TorchReference):
    """The reference's output copied by a Triton kernel (its length specialized)."""

    name = "copied"

    def run(self, inputs):
        out = self.reference(inputs).output.reshape(-1).contiguous()
        copy = torch.empty_like(out)
        _copy[(triton.cdiv(out.numel(), 256),)](out, copy, out.numel(), BLOCK=256)
        return copy.view(self.reference(inputs).output.shape)


DIFFTEST_BACKENDS = [Copied]
'''

TESTS = '''
def test_cases(check_case):
    from difftest.generation.corpus import load_corpus
    for case in load_corpus()[:3]:
        check_case(case)
'''


@needs_interpreter
def test_a_pytest_run_reports_its_kernel_specializations(tmp_path) -> None:
    """pytest with the plug-in: the report's ``kernel_compiles`` and the summary line count
    what the backend's interpreted launches would compile on a GPU."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "copying.py").write_text(COPYING_PLUGIN)
    (tmp_path / "test_copied.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_copied.py",
         "--difftest-plugin", "copying.py", "--difftest-backends", "copied",
         "--difftest-device", "cpu", "--difftest-report", "report.json"],
        cwd=tmp_path, env=env | {"HYPOTHESIS_PROFILE": "ci"}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    compiles = json.loads((tmp_path / "report.json").read_text())["config"]["kernel_compiles"]
    assert set(compiles) == {"copied"} and 1 <= compiles["copied"]["interpreted"] <= 3
    assert compiles["copied"]["compiled"] == 0
    assert "kernels: interpreted (TRITON_INTERPRET=1), none compiled; a GPU would compile" \
        in done.stdout
