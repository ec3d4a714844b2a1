"""Capability-aware generation: examples drawn over what some backend runs, each fitted to
every backend, so no argument one backend accepts is held fixed by another's refusal."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from difftest import cli
from difftest.case.selection import selection_is_canonical
from difftest.case.spec import Case
from difftest.contract.backend import Availability
from difftest.contract.registry import discover, select
from difftest.generation.capabilities import Capabilities, Fitted, variants
from difftest.generation.generate import generated_cases

CPU = torch.device("cpu")
STRUCTURE = ("num_blocks", "seq_lens", "block_tables", "selections", "decode_query_len",
             "num_q_heads", "softmax_scale", "kv_layout", "distribution", "seed")


@dataclasses.dataclass
class Picky:
    """A stand-in backend that refuses what ``refuses`` says."""

    name: str
    refuses: object
    reason: str
    available: bool = True
    in_page_orders: tuple[str, ...] = ("plain",)

    def availability(self) -> Availability:
        return Availability(self.available, "" if self.available else "no such hardware")

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        return self.reason if self.refuses(case) else None  # type: ignore[operator]


NO_BF16 = Picky("no-bf16", lambda c: c.query_dtype == "bfloat16", "bf16 queries miscomputed")
NO_FP32 = Picky("no-fp32", lambda c: c.query_dtype == "float32", "no fp32 queries")
NO_MODES = Picky("no-modes", lambda c: bool(c.kernel_modes), "no softcap, no window")
CANONICAL_ONLY = Picky("canonical-only", lambda c: not selection_is_canonical(c),
                       "irregular selections refused")


def ran_by(capabilities: Capabilities, examples: list[Case]) -> dict[str, list[Case]]:
    """The case each backend ran, per example."""
    out: dict[str, list[Case]] = defaultdict(list)
    for example in examples:
        for fitted in capabilities.fit(example):
            for name in fitted.backends:
                out[name].append(fitted.case)
    return out


def test_each_backend_runs_every_example_in_a_variant_it_accepts() -> None:
    capabilities = Capabilities.probe([NO_BF16, NO_FP32], CPU)
    examples = generated_cases(60, 0, capabilities.strategy, max_batch=2, max_topk=4)
    ran = ran_by(capabilities, examples)
    assert len(ran["no-bf16"]) == len(ran["no-fp32"]) == 60
    # every query dtype is drawn; each backend sees the two it accepts, none it refuses
    assert {c.query_dtype for c in examples} == {"float32", "float16", "bfloat16"}
    assert {c.query_dtype for c in ran["no-bf16"]} == {"float32", "float16"}
    assert {c.query_dtype for c in ran["no-fp32"]} == {"float16", "bfloat16"}
    for example, mine, theirs in zip(examples, ran["no-bf16"], ran["no-fp32"], strict=True):
        for case in (mine, theirs):  # the boundary the example carries is kept
            assert [getattr(case, f) for f in STRUCTURE] == [getattr(example, f)
                                                             for f in STRUCTURE]
    lines = capabilities.lines()
    assert "examples some backend could not run: 0 of 60 (0.0%)" in lines, lines
    assert any(line.startswith("fitted for no-bf16: ") and "query_dtype bfloat16 -> float16"
               in line and line.endswith(": bf16 queries miscomputed") for line in lines), lines


def test_a_variant_names_its_example_and_changes_only_what_it_says() -> None:
    example = Case(num_blocks=4, seq_lens=(130,), block_tables=((3, 1),),
                   selections=((0, 1),), query_dtype="bfloat16", kv_dtype="float8_e4m3fn",
                   k_scale=0.01, v_scale=20.0, softcap=30.0, sliding_window=5, canary=True)
    fp8_off = Picky("no-fp8", lambda c: c.kv_dtype.startswith("float8"), "no fp8 KV")
    capabilities = Capabilities.probe([NO_BF16, fp8_off], CPU)
    runs = capabilities.fit(example)
    assert [r.backends for r in runs] == [("no-bf16",), ("no-fp8",)]
    for run in runs:
        assert run.case.name == f"{example.case_id} fitted: {', '.join(run.changes)}"
        changed = {f.name for f in dataclasses.fields(Case) if f.name != "name"
                   and getattr(run.case, f.name) != getattr(example, f.name)}
        assert changed == {c.split()[0] for c in run.changes} | (
            {"k_scale", "v_scale"} if "kv_dtype" in changed else set())
    assert runs[0].changes == ("query_dtype bfloat16 -> float16",)
    assert runs[1].changes == ("kv_dtype float8_e4m3fn -> bfloat16",)
    assert (runs[1].case.k_scale, runs[1].case.v_scale) == (1.0, 1.0)


def test_variants_come_fewest_changes_first_and_are_all_valid() -> None:
    example = Case(num_blocks=2, seq_lens=(5,), block_tables=((1,),), selections=((0,),),
                   softcap=2.0, sliding_window=3)
    found = list(variants(example))
    sizes = [len(changes) for _, changes in found]
    assert sizes == sorted(sizes) and sizes[0] == 1
    assert len({case.case_id for case, _ in found}) == len(found)
    assert ("softcap off",) in [changes for _, changes in found]
    assert ("kernel modes off",) in [changes for _, changes in found]


def test_kernel_modes_are_drawn_if_some_backend_runs_them_and_fitted_off_for_the_rest() -> None:
    capabilities = Capabilities.probe([NO_BF16, NO_MODES], CPU)
    examples = generated_cases(60, 0, capabilities.strategy, max_batch=2, max_topk=4)
    ran = ran_by(capabilities, examples)
    assert any(c.kernel_modes for c in ran["no-bf16"])
    assert not any(c.kernel_modes for c in ran["no-modes"])
    assert len(ran["no-modes"]) == 60
    assert any(line.startswith("fitted for no-modes: ") for line in capabilities.lines())
    only = Capabilities.probe([NO_MODES], CPU)
    assert not any(c.kernel_modes for c in generated_cases(
        40, 0, only.strategy, max_batch=2, max_topk=4))
    assert ("not drawn for no-modes: kernel modes (softcap, sliding_window): no softcap, "
            "no window") in only.lines()


def test_an_example_no_variant_fits_is_redrawn_and_said() -> None:
    capabilities = Capabilities.probe([NO_BF16, CANONICAL_ONLY], CPU)
    examples = generated_cases(60, 0, capabilities.strategy, max_batch=2, max_topk=4,
                               selection_modes=("irregular", "indexer"))
    assert all(len(capabilities.fit(e)) >= 1 for e in examples)
    lines = capabilities.lines()
    assert any(line.startswith("redrawn ") and "canonical-only runs in no variant: irregular"
               in line for line in lines), lines


def test_unavailable_backends_are_said_and_the_rest_still_fitted() -> None:
    only_fp32 = Picky("fp32-only", lambda c: c.query_dtype != "float32", "fp32 queries only")
    gone = Picky("gone", lambda c: False, "", available=False)
    capabilities = Capabilities.probe([only_fp32, NO_FP32, gone], CPU)
    example = generated_cases(1, 0, capabilities.strategy, max_batch=1, max_topk=2)[0]
    runs = capabilities.fit(example)
    assert sorted(n for r in runs for n in r.backends) == ["fp32-only", "gone", "no-fp32"]
    assert {r.case.query_dtype for r in runs if "fp32-only" in r.backends} == {"float32"}
    # the unavailable backend is listed with the drawn case, where it reports itself
    assert [r.case for r in runs if "gone" in r.backends] == [example]
    assert "not drawn for gone: unavailable: no such hardware" in capabilities.lines()


def test_a_run_no_backend_is_left_for_is_dropped() -> None:
    example = Case(num_blocks=1, seq_lens=(1,), block_tables=((0,),), selections=((0,),),
                   query_dtype="bfloat16")
    runs = Capabilities.probe([NO_BF16], CPU).fit(example)
    assert runs == [Fitted(runs[0].case, ("no-bf16",), ("query_dtype bfloat16 -> float16",))]


def test_default_cpu_backends_run_every_example_and_vary_their_dtypes() -> None:
    """The README's default CPU run: plain generation leaves a third or more of the cases to
    fewer backends; fitted generation none, and each backend sees every query dtype it runs
    (checked by the backends' own declarations, without running them)."""
    names = ("triton-unified", "vllm-triton-sparse", "aiter-gluon@emulated")
    backends = [b for b in select(discover(), names) if b.availability().available]
    if len(backends) != len(names):
        pytest.skip("a default backend is unavailable here")
    plain = generated_cases(50, 0)
    assert sum(any(b.unsupported_reason(c, CPU) for b in backends) for c in plain) >= 15
    capabilities = Capabilities.probe(backends, CPU)
    ran = ran_by(capabilities, generated_cases(50, 0, capabilities.strategy))
    older = Counter()  # the variants for older releases that lack what a run needs
    for (name, _, reason), count in capabilities.fitted.items():
        older[name] += count * reason.startswith("for its releases that refuse it: ")
    for backend in backends:
        assert len(ran[backend.name]) == 50 + older[backend.name]
        assert not any(backend.unsupported_reason(c, CPU) for c in ran[backend.name])
    assert {c.query_dtype for c in ran["aiter-gluon@emulated"]} == {"float16", "bfloat16"}
    assert {c.query_dtype for c in ran["triton-unified"]} == {"float16", "float32"}
    assert any(c.kernel_modes for c in ran["triton-unified"])
    assert capabilities.examples_unfit / capabilities.examples < 0.05


def test_run_runs_each_fitted_variant_on_its_backends(tmp_path: Path, device_name: str) -> None:
    """``difftest run`` records each run of an example with the backends fitted to it."""
    report = tmp_path / "r.json"
    code = cli.main(["run", "--no-corpus", "--examples", "4", "--backends",
                     "aiter-gluon@emulated,triton-unified", "--device", device_name,
                     "--artifacts", str(tmp_path / "artifacts"), "--report", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    per_backend: dict[str, int] = defaultdict(int)
    for entry in data["cases"]:
        assert entry["results"], entry["case_id"]
        for result in entry["results"]:
            assert result["status"] == "agree", (entry["case_id"], result)
            per_backend[result["backend"]] += 1
        if entry["name"]:
            assert " fitted: " in entry["name"]
    # triton-unified also runs the variants its releases without kv_quant_mode run
    older = sum(int(line.split(" of 4 ")[0].rsplit(" ", 1)[1])
                for line in data["config"]["generation"]
                if line.startswith("fitted for triton-unified: ")
                and ": for its releases that refuse it: " in line)
    assert per_backend == {"aiter-gluon@emulated": 4, "triton-unified": 4 + older}
    assert data["config"]["generation"][-1] == "examples some backend could not run: 0 of 4 " \
                                               "(0.0%)"


def test_fit_all_runs_a_variant_two_examples_share_once_per_backend() -> None:
    first = Case(num_blocks=2, seq_lens=(5,), block_tables=((1,),), selections=((0,),),
                 query_dtype="bfloat16")
    second = first.replace(query_dtype="float16")  # first's variant for NO_BF16
    capabilities = Capabilities.probe([NO_BF16, NO_FP32], CPU)
    fitted = capabilities.fit(first)
    assert [f.case.query_dtype for f in fitted] == ["bfloat16", "float16"]
    runs = capabilities.fit_all([first, second, first])
    pairs = [(f.case.case_id, n) for f in runs for n in f.backends]
    # first: bf16 on no-fp32, its fp16 variant on no-bf16; second: fp16 on no-fp32 only
    assert sorted(pairs) == sorted([(first.case_id, "no-fp32"), (second.case_id, "no-bf16"),
                                    (second.case_id, "no-fp32")])


def test_a_prefill_example_is_fitted_to_a_backend_without_query_lens() -> None:
    """``query_lens`` off keeps each request's decode row (Case.mode_off), so an example with
    prefill-like rows still runs on a backend that refuses them, and is not redrawn."""
    no_prefill = Picky("no-prefill", lambda c: bool(c.query_lens), "no prefill rows")
    example = Case(num_blocks=4, seq_lens=(130, 5), block_tables=((3, 1), (2,)),
                   selections=((0, 1), (0, 1), (0, -1)), query_lens=(2, 1),
                   decode_query_len=1)
    capabilities = Capabilities.probe([no_prefill, NO_BF16], CPU)
    assert capabilities.accept(example)
    runs = {r.backends: r for r in capabilities.fit(example)}
    assert runs[("no-prefill",)].changes == ("query_lens off",)
    assert runs[("no-prefill",)].case == example.mode_off("query_lens")
    assert runs[("no-bf16",)].case == example


@dataclasses.dataclass
class Released(Picky):
    """A stand-in whose older releases refuse what ``older`` says."""

    older: object = None

    def unsupported_in_some_release(self, case: Case, device: torch.device) -> str | None:
        return "older releases lack it" if self.older(case) else None  # type: ignore[misc]


def test_an_example_older_releases_refuse_also_runs_their_nearest_variant() -> None:
    """A float32-query example on a backend whose older releases run float16 only: the drawn
    case (the newer releases run it) and its float16 variant (every release runs it)."""
    backend = Released("released", lambda c: c.query_dtype == "bfloat16", "no bf16",
                       older=lambda c: c.query_dtype != "float16")
    example = Case(num_blocks=2, seq_lens=(5,), block_tables=((1,),), selections=((0,),),
                   query_dtype="float32")
    capabilities = Capabilities.probe([backend], CPU)
    runs = capabilities.fit(example)
    assert [(r.case.query_dtype, r.backends, r.changes) for r in runs] == [
        ("float32", ("released",), ()),
        ("float16", ("released",), ("query_dtype float32 -> float16",))]
    assert ("fitted for released: 1 of 1 example(s) ran with query_dtype float32 -> float16: "
            "for its releases that refuse it: older releases lack it") in capabilities.lines()
    assert capabilities.fit(example.replace(query_dtype="float16"))[0].changes == ()
    assert len(capabilities.fit(example.replace(query_dtype="float16"))) == 1
