"""Every canary kind catches a kernel that reads it, on the CPU (interpreted) and on a GPU.

The canaries (difftest/inputs/kv_cache.py): NaN on every page no row attends, finite poison past a
request's written tokens and on page 0 of block 0 (vLLM's null block), and with ``canary``
NaN on every slot of an attended block that no row reads. Each test runs vLLM's real
``unified_attention`` with one reading bug planted (a table entry, a context length, or the
kernel's own sliding-window mask of V removed, which is vLLM 0.13.0's NaN) and checks that
the canary is what shows it: NaN in the output for NaN canaries, the poison's magnitude for
poison. The fp8 variants need the interpreter to decode fp8 NaN bytes as NaN
(difftest/machine/interpreter.py, ``decode_fp8_specials``): without it they agree on the CPU.
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.generation.dense import dense_rows
from difftest.machine import devices
from difftest.results.records import Status
from difftest.run.runner import run_case

# the line of vLLM 0.33.0's kernel that zeroes V outside the sliding window (0.13.0 lacked it)
V_WINDOW_MASK = "            V = tl.where(sw_mask_v, V, 0.0)\n"
KV_DTYPES = ("float16", "float8_e4m3fn", "float8_e4m3fnuz")


@pytest.fixture(scope="module")
def device(device_name: str) -> torch.device:
    return torch.device(device_name)


def case_of(kv_dtype: str, seq_len: int = 44, **changes) -> Case:
    """One request on blocks 2, 3, 4 of 16-token pages in vLLM's split cache (6 blocks: 0, 1
    and 5 unattended), a dense decode row."""
    blocks = -(-seq_len // 16)
    table = tuple(range(2, 2 + blocks))
    scale = 0.5 if kv_dtype.startswith("float8") else 1.0
    fields = dict(num_blocks=6, seq_lens=(seq_len,), block_tables=(table,),
                  selections=(tuple(dense_rows(seq_len, 1, 16, blocks)[0]),), num_q_heads=4,
                  num_kv_heads=2, head_dim=64, block_size=16, page_size=16, kv_layout="split",
                  kv_dtype=kv_dtype, k_scale=scale, v_scale=scale, softmax_scale=0.125,
                  dense=True)
    return Case(**(fields | changes))


@contextmanager
def reading(inputs: RunInputs, table: torch.Tensor, ctx: torch.Tensor) -> Iterator[None]:
    """The kernel reads ``(table, ctx)`` as its page table while it runs; the shared inputs
    hold theirs again afterwards (backends must leave them as they found them)."""
    shared = inputs.sparse_table
    inputs.__dict__["sparse_table"] = (table, ctx)
    try:
        yield
    finally:
        inputs.__dict__["sparse_table"] = shared


class ReadsBlock(TritonUnifiedAttention):
    """Reads ``block`` in place of the request's second block (its table entry)."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block
        self.name = f"triton-unified!reads-block-{block}"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        table, ctx = inputs.sparse_table
        table = table.clone()
        table[:, 1] = self.block
        with reading(inputs, table, ctx):
            return super().run(inputs)


class ReadsPastContext(TritonUnifiedAttention):
    """Reads one token past each row's context (the slot after the written tokens)."""

    name = "triton-unified!reads-past-context"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        table, ctx = inputs.sparse_table
        with reading(inputs, table, ctx + 1):
            return super().run(inputs)


@pytest.fixture(scope="module")
def kernel_without_window_mask(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vLLM tree whose unified_attention lacks the V mask of the sliding window."""
    import vllm

    source = Path(vllm.__file__).parent
    tree = tmp_path_factory.mktemp("vllm-window-nan") / "vllm"
    ops = tree / "v1" / "attention" / "ops"
    shutil.copytree(source / "v1" / "attention" / "ops", ops)
    (tree / "__init__.py").write_text("")
    kernel = ops / "triton_unified_attention.py"
    text = kernel.read_text()
    assert text.count(V_WINDOW_MASK) == 1, "vLLM's sliding-window mask of V moved"
    kernel.write_text(text.replace(V_WINDOW_MASK, ""))
    return tree


def outcome(case: Case, backend: TritonUnifiedAttention, device: torch.device):
    result = run_case(case, TorchReference(), [backend], device).results[0]
    if result.status is Status.UNSUPPORTED:  # e4m3fnuz on an NVIDIA GPU
        pytest.skip(result.detail)
    assert result.status in (Status.AGREE, Status.DISAGREE), result.detail
    return result


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_kernel_reading_an_unattended_page_meets_nan(kv_dtype: str, device) -> None:
    result = outcome(case_of(kv_dtype), ReadsBlock(5), device)
    assert result.status is Status.DISAGREE
    assert result.comparison.nonfinite > 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_kernel_reading_the_null_block_meets_its_poison(kv_dtype: str, device) -> None:
    result = outcome(case_of(kv_dtype), ReadsBlock(0), device)
    assert result.status is Status.DISAGREE
    assert result.comparison.max_ratio > 10


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_kernel_reading_past_the_written_tokens_meets_poison(kv_dtype: str, device) -> None:
    """Slots 44..47 of the last page hold poison (192 in K and V). A query head whose
    ``q . k`` with the poison is very negative weights it by 0, so the poison shows in the
    heads where it is positive: 16 heads, about half of them."""
    case = case_of(kv_dtype, seq_len=44, num_q_heads=16)
    result = outcome(case, ReadsPastContext(), device)
    assert result.status is Status.DISAGREE
    assert result.comparison.max_ratio > 10


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_kernel_weighting_canary_slots_by_zero_meets_nan(kv_dtype: str, device,
                                                           kernel_without_window_mask) -> None:
    """vLLM 0.13.0's sliding-window NaN: V outside the window multiplied by a zero weight.
    The slots before the window are NaN canaries; the fixed kernel agrees."""
    case = case_of(kv_dtype, seq_len=44, sliding_window=9, canary=True)
    assert outcome(case, TritonUnifiedAttention(), device).status is Status.AGREE
    buggy = TritonUnifiedAttention(vllm=str(kernel_without_window_mask))
    result = outcome(case, buggy, device)
    assert result.status is Status.DISAGREE
    assert result.comparison.nonfinite > 0


@pytest.mark.skipif(not devices.interpreted(), reason="pins the interpreter's fp8 decoding "
                    "(a GPU decodes fp8 itself)")
def test_fp8_canaries_are_silent_on_the_cpu_without_the_decode(
        kernel_without_window_mask, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.8.0's own conversion turns the NaN canary into 480 (e4m3fn), and 480 times a
    zero weight is 0: the buggy kernel agrees. With the decode it disagrees (the test above)."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_convert_float", inspect.unwrap(interpreter._convert_float))
    case = case_of("float8_e4m3fn", seq_len=44, sliding_window=9, canary=True)
    buggy = TritonUnifiedAttention(vllm=str(kernel_without_window_mask))
    assert outcome(case, buggy, torch.device("cpu")).status is Status.AGREE
