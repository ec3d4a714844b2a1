"""The parameter-coverage audit and the statements it reads: each backend states every
parameter of the kernel it called, from the arguments of the call; the audit collects the
statements of a run, flags an argument that never varies and names no backend."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.kernel_call import KernelCall, StatedArgument, kernel_call
from difftest.contract.registry import discover, select
from difftest.judgement import audit as audit_module
from difftest.judgement.audit import audit, audit_json, audit_lines, blind_spots
from difftest.run.runner import run_case

CPU = torch.device("cpu")
DEFAULT_CPU_BACKENDS = ("triton-unified", "vllm-triton-sparse", "aiter-gluon@emulated",
                        "vllm-aiter@emulated", "vllm-paged-decode", "vllm-decode-attention")


def toy_kernel(q, k, scale=1.0, mode="off", *, window=0):
    """A stand-in kernel signature."""


def test_a_statement_walks_the_kernel_signature_with_defaults_labels_and_reasons() -> None:
    call = kernel_call(toy_kernel, {"q": torch.zeros(3, 16, 128, dtype=torch.float16),
                                    "k": torch.zeros(4, 16), "scale": 0.5},
                       labels={"k": "LBHNC 4 pages"}, fixed={"mode": "never on", "window":
                                                             "no window"},
                       sizes={"head_dim": (128, "q.shape[2]")})
    assert call.kernel == "toy_kernel"
    assert list(call.arguments) == ["q", "k", "scale", "mode", "window", "head_dim"]
    assert call.arguments["q"] == StatedArgument("float16 [N, 16, 128]")
    assert call.arguments["k"].label == "LBHNC 4 pages"
    assert call.arguments["scale"].label == "0.5"
    assert call.arguments["mode"] == StatedArgument("default off", "never on")
    assert call.arguments["head_dim"] == StatedArgument("128", "", "q.shape[2]")


def test_a_statement_of_an_argument_the_kernel_does_not_take_is_an_error() -> None:
    with pytest.raises(ValueError, match="passed argument 'softcap' is not a parameter"):
        kernel_call(toy_kernel, {"q": 1, "k": 2, "softcap": 3.0})


def _record(backend: str, status: str, **labels: str) -> dict:
    arguments = {name: {"label": label, "fixed": "held" if name == "mode" else "",
                        "shape": ""} for name, label in labels.items()}
    return {"results": [{"backend": backend, "status": status,
                         "calls": [{"kernel": "toy_kernel", "arguments": arguments}]}]}


def test_one_value_is_blind_a_second_lifts_it_and_fixed_is_never_blind() -> None:
    runs = [_record("b", "agree", scale="1", mode="off"),
            _record("b", "agree", scale="1", mode="off")]
    assert [c.argument for c in blind_spots(runs, ["b"])] == ["scale"]
    runs.append(_record("b", "disagree", scale="0.5", mode="off"))
    assert blind_spots(runs, ["b"]) == []
    (mode,) = [c for c in audit(runs, ["b"]) if c.argument == "mode"]
    assert mode.fixed == "held" and mode.values == ("off",) and not mode.blind


def test_an_argument_stated_fixed_that_varied_is_shown_varying() -> None:
    """A reason an argument is fixed holds for one geometry (a kernel's shape arguments over
    the sparse family); where the cases varied it, the audit showed the values and still
    called it fixed."""
    runs = [_record("b", "agree", mode="off"), _record("b", "agree", mode="on")]
    (mode,) = audit(runs, ["b"])
    assert mode.values == ("off", "on") and mode.fixed == "" and not mode.blind
    assert not any("fixed" in line for line in audit_lines(runs, ["b"]))


def test_only_the_cases_a_backend_ran_count() -> None:
    runs = [_record("b", "agree", scale="1"), _record("b", "unsupported", scale="0.5")]
    (scale,) = audit(runs, ["b"])
    assert scale.cases == 1 and scale.blind


def test_lines_and_json_render_the_statements() -> None:
    runs = [_record("b", "agree", scale="1", mode="off"), {"results": [
        {"backend": "ref", "status": "agree"}]}]
    lines = audit_lines(runs, ["b", "ref", "other"])
    assert lines[0] == "parameter coverage over 2 cases"
    assert "  b -> toy_kernel (1 calls stated in 1 cases)" in lines
    assert any(line.split()[0] == "scale" and "BLIND 1 value(s): 1" in line for line in lines)
    assert any(line.split()[0] == "mode" and "fixed: held" in line for line in lines)
    assert "  ref: ran 1 case(s), stated no kernel call" in lines
    assert "  other: ran no case, not audited" in lines
    report = audit_json(runs, ["b", "ref"])
    assert report["backends"]["b"]["kernels"]["toy_kernel"]["arguments"][0] == {
        "name": "scale", "values": ["1"], "fixed": None, "blind": True}
    assert "ref" not in report["backends"]


def test_the_audit_names_no_backend_and_no_kernel() -> None:
    source = Path(inspect.getfile(audit_module)).read_text()
    for name in discover():
        assert name.split("@")[0] not in source, name
    for kernel in ("unified_attention", "pa_decode_gluon", "minimax_m3",
                   "kernel_paged_attention_2d", "decode_attention_fwd"):
        assert kernel not in source


def _backends(case: Case) -> list:
    """The default CPU backends, and AITER's unified_attention where its tree is set up and
    its release runs ``case`` (the wheel has no shuffled views)."""
    found = [b for b in select(discover(), DEFAULT_CPU_BACKENDS) if b.availability().available]
    if len(found) != len(DEFAULT_CPU_BACKENDS):
        pytest.skip("a default CPU backend is unavailable here")
    return found + [b for b in select(discover(), ["aiter-unified", "aiter-unified@shuffled"])
                    if b.availability().available and b.unsupported_reason(case, CPU) is None]


def _parameters(kernel: object) -> list[str]:
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_backend_states_every_parameter_of_the_kernel_it_called() -> None:
    """One small case on every default CPU backend: the statement lists the kernel's whole
    signature in order (then the sizes it reads from shapes), each with a label, and a
    parameter the backend leaves at its default says so."""
    case = Case(num_blocks=4, seq_lens=(300,), block_tables=((2, 0, 3),),
                selections=((0, 1, 2),))
    backends = _backends(case)
    result = run_case(case, TorchReference(), backends, CPU)
    for backend, outcome in zip(backends, result.results, strict=True):
        assert outcome.status.value == "agree", (backend.name, outcome.detail)
        (call,) = outcome.calls
        assert isinstance(call, KernelCall)
        stated = list(call.arguments)
        signatures = _loaded_signatures(call.kernel)
        assert any(stated[: len(p)] == p for p in signatures), (backend.name, signatures)
        # the longest: another release's shorter signature may be loaded in this process
        parameters = max((p for p in signatures if stated[: len(p)] == p), key=len)
        assert all(a.label for a in call.arguments.values())
        assert all(a.shape for n, a in call.arguments.items()
                   if n not in parameters), backend.name


def _loaded_signatures(name: str) -> list[list[str]]:
    """The parameter lists of every loaded kernel called ``name`` (vLLM's and AITER's
    ``unified_attention`` share a name)."""
    import sys

    found = []
    for module in list(sys.modules.values()):
        kernel = getattr(module, name, None)
        if callable(kernel) and getattr(getattr(kernel, "fn", kernel), "__name__", "") == name:
            found.append(_parameters(kernel))
    return found
