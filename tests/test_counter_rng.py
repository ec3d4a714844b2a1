"""Counter-based data generation: deterministic, independent of other blocks, pinned bits."""

from __future__ import annotations

import hashlib

import pytest
import torch

from difftest.case.selection import build_rows
from difftest.case.spec import Case
from difftest.inputs.case_data import generate, quantize
from difftest.machine import devices
from difftest.primitives import counter_rng


def test_values_are_pinned_bit_for_bit() -> None:
    """A change here changes every case's data: gates across versions would compare nothing."""
    values = counter_rng.normal(1234, 2, torch.arange(4096))
    digest = hashlib.sha256(values.numpy().tobytes()).hexdigest()[:16]
    assert digest == PINNED_NORMAL_DIGEST
    assert abs(float(values.mean())) < 0.05 and abs(float(values.std()) - 1) < 0.05


def test_block_data_does_not_depend_on_other_blocks() -> None:
    one = Case(num_blocks=32, seq_lens=(100,), block_tables=((7,),), selections=((0,),))
    two = Case(num_blocks=32, seq_lens=(100, 50), block_tables=((7,), (3,)),
               selections=((0,), (0,)))
    a, b = generate(one, build_rows(one)), generate(two, build_rows(two))
    assert torch.equal(a.k_stored[a.slot_of[7]], b.k_stored[b.slot_of[7]])
    assert torch.equal(a.v_stored[a.slot_of[7]], b.v_stored[b.slot_of[7]])


def test_seed_changes_data() -> None:
    case = Case(num_blocks=8, seq_lens=(10,), block_tables=((1,),), selections=((0,),))
    other = case.replace(seed=1)
    assert not torch.equal(generate(case, build_rows(case)).query,
                           generate(other, build_rows(other)).query)


def test_cpu_hashing_equals_the_int64_formulation() -> None:
    """The chunked numpy uint32 path gives the bits of the torch int64 ops (the GPU's)."""
    generator = torch.Generator().manual_seed(3)
    index = torch.randint(0, 2**48, (2 * counter_rng._CHUNK + 5,), generator=generator)
    for seed in (0, 2**40 + 5):
        first, second = counter_rng.hash64(seed, 7, index)
        total = (first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16)
        normal = ((total.to(torch.float32) + 2.0) * 2.0**-16 - 2.0) * 1.7320508075688772
        assert torch.equal(counter_rng.normal(seed, 7, index), normal)
        uniform = (first >> 8).to(torch.float32) * 2.0**-24
        assert torch.equal(counter_rng.uniform(seed, 7, index), uniform)
    rows = torch.tensor([5, 0, 2**30 + 1])
    length = counter_rng._CHUNK // 2 + 3  # row groups straddle the chunks
    index = rows.view(-1, 1) * length + torch.arange(length)
    assert torch.equal(counter_rng.normal_rows(9, 2, rows, length), counter_rng.normal(9, 2, index))
    assert torch.equal(counter_rng.uniform_rows(9, 2, rows, length),
                       counter_rng.uniform(9, 2, index))


def test_the_gpu_kernel_gives_the_cpu_bits_in_the_interpreter() -> None:
    """The fused GPU draw (difftest/primitives/_counter_rng_triton.py, uint32 lanes), run by
    Triton's interpreter: the CPU's bits for keys below and from 2**31 and for flat indices past
    2**32 (the high word), plain, and divided and saturated as ``quantize`` does before its cast
    (the fp8 cast itself is the GPU's: tests/test_device_determinism.py)."""
    if not devices.interpreted():
        pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    from difftest.primitives import _counter_rng_triton as kernels

    rows = torch.tensor([0, 3, 2**33 // 1500 + 7])  # the last row's indices pass 2**32
    for seed in (0, 5, 2**40 + 5):
        key = counter_rng.stream_key(seed, 1)
        want = counter_rng.normal_rows(seed, 1, rows, 1500)
        assert torch.equal(kernels.normal_rows_triton(key, rows, 1500), want)
        stored = kernels.stored_normal_rows_triton(key, rows, 1500, torch.float16, 0.01, 448.0)
        divided = (want / 0.01).clamp(-448.0, 448.0)  # quantize's float32 steps before its cast
        assert torch.equal(stored, divided.half())
        assert torch.equal(divided.to(torch.float8_e4m3fn),
                           quantize(want, "float8_e4m3fn", 0.01))
    keys = {counter_rng.stream_key(seed, 1) >= 2**31 for seed in (0, 5, 2**40 + 5)}
    assert keys == {False, True}  # both signs of the int32 the key is passed as


PINNED_NORMAL_DIGEST = "7648d59e3952598e"
