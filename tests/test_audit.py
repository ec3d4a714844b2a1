"""The parameter-coverage audit: its argument lists are the kernels' signatures, it sees the
values the cases give, and it flags an argument that never varies."""

from __future__ import annotations

import inspect

import pytest
import torch

from difftest.audit import (
    DIMENSIONS,
    KERNELS,
    Argument,
    audit,
    audit_json,
    audit_lines,
    blind_spots,
    kernel_of,
)
from difftest.backends.pa_decode_gluon_contract import GluonEmulator
from difftest.backends.vllm_imports import import_minimax_m3
from difftest.case import BLOCK_SIZE, HEAD_DIM, PAGE_SIZE, Case
from difftest.cases.capabilities import Capabilities
from difftest.cases.corpus import load_corpus
from difftest.cases.generate import generated_cases
from difftest.dtypes import KV_DTYPES, QUERY_DTYPES
from difftest.registry import discover, select

CPU = torch.device("cpu")

# AITER pa_decode_gluon, aiter/ops/triton/gluon/pa_decode_gluon.py L5195-5216 at 37b5395e
AITER_PA_DECODE_GLUON = (
    "output", "query", "key_cache", "value_cache", "context_lengths", "block_tables",
    "softmax_scale", "query_length", "max_context_partition_num", "context_partition_size",
    "compute_type", "query_scale", "key_scale", "value_scale", "exp_sums", "max_logits",
    "temporary_output", "alibi_slopes", "sinks", "sliding_window", "ps")
DEFAULT_CPU_BACKENDS = ("triton-unified", "vllm-triton-sparse", "aiter-gluon@emulated",
                        "vllm-aiter@emulated")


def _parameters(function: object) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(function).parameters if p != "self")


def test_argument_lists_are_the_installed_signatures() -> None:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    sparse_attn = import_minimax_m3("common.ops.sparse_attn")
    sparse_pa = import_minimax_m3("amd.ops.sparse_pa")
    signatures = {
        "unified_attention": _parameters(unified_attention),
        "minimax_m3_sparse_attn_decode": _parameters(sparse_attn.minimax_m3_sparse_attn_decode),
        "minimax_m3_sparse_attn_decode_aiter": _parameters(
            sparse_pa.minimax_m3_sparse_attn_decode_aiter),
        "pa_decode_gluon": AITER_PA_DECODE_GLUON,
    }
    assert _parameters(GluonEmulator.pa_decode_gluon) == AITER_PA_DECODE_GLUON
    for kernel, arguments in KERNELS.items():
        assert tuple(a.name for a in arguments) == signatures[kernel], kernel
        assert all(a.value is not None or a.fixed for a in arguments), kernel


def test_backend_names_map_to_their_kernel() -> None:
    assert kernel_of("triton-unified") == "unified_attention"
    assert kernel_of("triton-unified!page-stride-8") == "unified_attention"
    assert kernel_of("aiter-gluon@emulated[k_trim=off]") == "pa_decode_gluon"
    assert kernel_of("torch-ref") is None


def test_a_single_value_is_a_blind_spot_and_a_second_value_lifts_it() -> None:
    case = load_corpus()[0]
    blind = {c.argument.name for c in blind_spots([case], ["aiter-gluon@emulated"])}
    assert {"query", "softmax_scale", "key_cache"} <= blind
    other = case.replace(softmax_scale=1.0)
    assert "softmax_scale" not in {c.argument.name for c in blind_spots(
        [case, {"case": other.to_dict()}], ["aiter-gluon@emulated"])}


def test_fixed_arguments_are_never_blind() -> None:
    case = load_corpus()[0]
    for coverage in audit([case], ["triton-unified"]):
        if coverage.argument.fixed:
            assert not coverage.blind
            assert len(coverage.values) == (coverage.argument.value is not None)


def _default_backends() -> list:
    backends = [b for b in select(discover(), DEFAULT_CPU_BACKENDS)
                if b.availability().available]
    if len(backends) != len(DEFAULT_CPU_BACKENDS):
        pytest.skip("a default CPU backend is unavailable here")
    return backends


def _run(backends: list) -> list:
    """The README's default CPU run: the corpus plus 50 cases drawn for ``backends``."""
    return load_corpus() + generated_cases(50, 0, Capabilities.probe(backends, CPU).strategy())


@pytest.mark.parametrize("name", DEFAULT_CPU_BACKENDS)
def test_a_backend_run_alone_varies_every_argument_not_fixed(name: str) -> None:
    (backend,) = [b for b in _default_backends() if b.name == name]
    assert [c.argument.name for c in blind_spots(_run([backend]), [backend], CPU)] == []


def test_the_default_run_leaves_only_the_dtypes_other_backends_refuse() -> None:
    """Drawn for all four default CPU backends, the only query dtype every one of them runs
    is float16 (Triton's interpreter refuses bf16, AITER fp32): an argument that is a dtype
    alone may then be blind, nothing else."""
    backends = _default_backends()
    dtypes = set(QUERY_DTYPES) | set(KV_DTYPES) | {"fp8"}
    blind = blind_spots(_run(backends), backends, CPU)
    assert all(set(c.values) <= dtypes for c in blind), blind


def test_records_count_only_the_cases_a_backend_ran() -> None:
    case = load_corpus()[0]
    other = case.replace(softmax_scale=1.0)
    records = [{"case": case.to_dict(), "results": [{"backend": "triton-unified",
                                                     "status": "agree"}]},
               {"case": other.to_dict(), "results": [{"backend": "triton-unified",
                                                      "status": "unsupported"}]}]
    (scale,) = [c for c in audit(records, ["triton-unified"]) if c.argument.name ==
                "softmax_scale"]
    assert scale.cases == 1 and scale.blind
    records[1]["results"][0]["status"] = "disagree"
    assert "softmax_scale" not in {c.argument.name for c in blind_spots(records,
                                                                        ["triton-unified"])}


def test_lines_show_values_fixed_reasons_and_unknown_backends() -> None:
    cases = load_corpus()
    lines = audit_lines(cases, ["torch-ref", "aiter-gluon@emulated"])
    assert lines[0] == f"parameter coverage over {len(cases)} cases"
    assert "  torch-ref: no kernel signature known to the audit" in lines
    assert any(line.split()[0] == "query_length" and "fixed 1:" in line for line in lines[2:])
    assert any(line.split()[0] == "compute_type" and "value(s):" in line for line in lines[2:])


# The sizes of MiniMax-M3's geometry (the sparse family's; difftest/case.py MODEL_GEOMETRY), by
# kernel: which each kernel reads from its tensors (minimax-m3-sparse-decode.md sections 1, 3,
# 5). unified_attention also runs the dense family's other geometry, so its sizes are measured.
HELD = {"head_dim": str(HEAD_DIM), "page_size": str(PAGE_SIZE), "block_size": str(BLOCK_SIZE),
        "num_kv_heads": "1"}
SIZES_BY_KERNEL = {
    "unified_attention": {"head_dim", "page_size", "block_size", "num_kv_heads"},
    "minimax_m3_sparse_attn_decode": {"head_dim", "block_size"},  # kv_cache [B, nkv, 128, 2D]
    "minimax_m3_sparse_attn_decode_aiter": {"head_dim", "page_size", "block_size"},
    "pa_decode_gluon": {"head_dim", "page_size", "block_size", "num_kv_heads"},
}
MEASURED = {"unified_attention"}
OTHER_GEOMETRY = {"head_dim": 96, "page_size": 32, "block_size": 256, "num_kv_heads": 2}


@pytest.mark.parametrize("size", sorted(HELD))
def test_the_m3_backends_refuse_each_size_the_audit_lists_as_fixed(size: str) -> None:
    """A case off MiniMax-M3's geometry in one size is refused by each backend whose kernel
    lists that size as fixed, naming it; triton-unified runs it."""
    case = Case(num_blocks=4, seq_lens=(100,), block_tables=((1,),), selections=((0,),),
                num_q_heads=4)
    other = case.replace(**{size: OTHER_GEOMETRY[size]})
    cpu = torch.device("cpu")
    for backend in select(discover(), list(DEFAULT_CPU_BACKENDS)):
        kernel = kernel_of(backend.name)
        reason = backend.unsupported_reason(other, cpu)
        if kernel in MEASURED:
            assert reason is None, (backend.name, reason)
        elif any(a.name == size for a in DIMENSIONS[kernel]):
            assert reason is not None and f"{size} {OTHER_GEOMETRY[size]}" in reason


def test_sizes_read_from_shapes_are_listed_as_fixed_with_reasons_and_where() -> None:
    """head dim 128, page size 16, block size 128 (and one KV head where it is in a shape)
    are fixed entries of every kernel that reads them, with the arguments that carry them,
    in the text and the JSON as num_kv_heads is; unified_attention's are measured, with the
    same reasons for the model's value."""
    assert {k: {a.name for a in sizes} for k, sizes in DIMENSIONS.items()} == SIZES_BY_KERNEL
    signature_names = {k: {a.name for a in args} for k, args in KERNELS.items()}
    for kernel, sizes in DIMENSIONS.items():
        for size in sizes:
            assert size.fixed_value == HELD[size.name], size
            assert (size.value is not None) == (kernel in MEASURED), size
            assert len(size.fixed) > 40 and size.shape, size
            carried = {part.split(".")[0].split()[0] for part in
                       size.shape.replace(";", ",").split(",")}
            assert carried & signature_names[kernel], (kernel, size.name, size.shape)
    case = load_corpus()[0]
    names = list(DEFAULT_CPU_BACKENDS)
    lines = audit_lines([case], names)
    report = audit_json([case], names)
    assert report["cases"] == 1
    for name in names:
        kernel = kernel_of(name)
        entries = {e["name"]: e for e in report["backends"][name]["arguments"]}
        assert report["backends"][name]["kernel"] == kernel
        assert [e for e in entries if e in HELD] == [
            a.name for a in KERNELS[kernel] + DIMENSIONS[kernel] if a.name in HELD]
        for size in DIMENSIONS[kernel]:
            entry = entries[size.name]
            assert entry["fixed"] == {"value": HELD[size.name], "reason": size.fixed,
                                      "shape": size.shape}
            measured = [HELD[size.name]] if kernel in MEASURED else []
            assert entry["values"] == measured and not entry["blind"]
    for kernel, size in [("minimax_m3_sparse_attn_decode", "head_dim"),
                         ("pa_decode_gluon", "block_size")]:
        (argument,) = [a for a in DIMENSIONS[kernel] if a.name == size]
        assert any(line.split()[0] == size and f"fixed {HELD[size]} ({argument.shape}): "
                   f"{argument.fixed}" in line for line in lines)
    assert not any(c.argument.name in HELD for c in blind_spots(load_corpus(), names))


def test_an_accepted_size_without_a_reason_that_took_one_value_is_still_blind(
        monkeypatch) -> None:
    """Documenting sizes as fixed must not weaken the check: a size (or any argument) the
    kernel accepts that took a single value and has no reason is a blind spot, in the list,
    the text and the JSON; a second value lifts it."""
    undocumented = Argument("head_dim", lambda c: c.head_dim, shape="q.shape[2]")
    monkeypatch.setitem(DIMENSIONS, "unified_attention", (undocumented,))
    case = load_corpus()[0]
    assert "head_dim" in {c.argument.name for c in blind_spots([case], ["triton-unified"])}
    (line,) = [line for line in audit_lines([case], ["triton-unified"])
               if line.split()[0] == "head_dim"]
    assert f"BLIND 1 value(s): {HEAD_DIM}" in line
    (entry,) = [e for e in audit_json([case], ["triton-unified"])["backends"][
        "triton-unified"]["arguments"] if e["name"] == "head_dim"]
    assert entry == {"name": "head_dim", "values": [str(HEAD_DIM)], "fixed": None,
                     "blind": True}
    varied = Argument("head_dim", lambda c: c.seed % 2)  # a stand-in for a second head dim
    monkeypatch.setitem(DIMENSIONS, "unified_attention", (varied,))
    assert "head_dim" not in {c.argument.name for c in blind_spots(
        [case, case.replace(seed=case.seed + 1)], ["triton-unified"])}
