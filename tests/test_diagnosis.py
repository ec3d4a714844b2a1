"""The diagnosis of a disagreement names what the backend read instead.

Each planted bug of the mutation catalogue, run by the engine on a case that reaches it,
must be diagnosed as the hypothesis its mutation declares; a correct output gets no
diagnosis, a random one "no simple hypothesis", and a diagnosis that fails is a line, never
an error.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.contract.compare import compare
from difftest.contract.tolerance import Tolerance
from difftest.judgement import diagnosis
from difftest.judgement.diagnosis import HYPOTHESIS_NAMES, NOTHING, diagnose, hypothesis_of
from difftest.results.features import case_features
from difftest.results.records import CaseRecord
from difftest.run.runner import Status, run_case
from mutants.catalog import DIFFTEST_BACKENDS, K_TRIM_OFF

MUTANTS = {m.name: m for m in DIFFTEST_BACKENDS}
# Two requests of two query tokens over packed fp8 blocks with distinct scales: every bug of
# the catalogue but the 16-bit truncation (which needs page ids past 2**16) reaches it.
CASE = Case(num_blocks=8, seq_lens=(300, 200), block_tables=((5, 1, 6), (2, 7)),
            selections=((0, 1, 2), (0, 1, 2), (0, 1, -1), (0, 1, -1)), decode_query_len=2,
            num_q_heads=4, query_dtype="float16", kv_dtype="float8_e4m3fn", k_scale=0.5,
            v_scale=2.0, name="diagnosis")
# One row reading physical block 4096 (page ids 65536..65543) and block 3.
PAST_2_16 = Case(num_blocks=4097, seq_lens=(200,), block_tables=((4096, 3),),
                 selections=((0, 1),), num_q_heads=4, query_dtype="float16",
                 kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, name="past-2**16")
# Every kernel mode the catalogue plants a bug in, with a non-default softmax scale.
MODES = Case(num_blocks=8, seq_lens=(300, 200), block_tables=((5, 1, 6), (2, 7)),
             selections=((0, 1, 2), (0, 1, -1)), num_q_heads=4, query_dtype="float16",
             kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, softcap=5.0,
             sliding_window=100, softmax_scale=0.2, name="modes")
DIAGNOSED = [n for n, m in MUTANTS.items() if m.mutation.diagnosis]


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    return difftest_session.device


def test_every_harmful_mutation_declares_a_known_hypothesis() -> None:
    """The catalogue's expectations name hypotheses the diagnosis tests; only the K-trim
    mismatch (an error: no output) and the harmless control declare none."""
    for mutant in MUTANTS.values():
        expected = mutant.mutation.diagnosis
        if mutant.mutation.harmful and mutant.mutation is not K_TRIM_OFF:
            assert expected in HYPOTHESIS_NAMES, mutant.name
        else:
            assert expected == "", mutant.name
    assert len(DIAGNOSED) == 16


@pytest.mark.parametrize("name", DIAGNOSED)
def test_planted_bug_is_diagnosed_as_itself(name: str, device: torch.device) -> None:
    mutant = MUTANTS[name]
    case = next(c for c in (CASE, PAST_2_16, MODES) if mutant.mutation.reachable(c))
    result = run_case(case, TorchReference(), [mutant], device)
    outcome = result.results[0]
    assert outcome.status is Status.DISAGREE, outcome.detail
    lines = outcome.comparison.diagnosis
    assert lines and hypothesis_of(lines[0]) == mutant.mutation.diagnosis, lines
    message = result.failure_messages()[0]
    assert "Diagnosis (what the worst rows read instead):" in message
    assert lines[0] in message
    record = json.loads(json.dumps(result.record().to_dict()))
    back = CaseRecord.from_dict(record, "case")
    assert back.results[0].comparison.diagnosis == lines


def test_truncation_line_names_the_page_read(device: torch.device) -> None:
    mutant = MUTANTS["triton-unified!page-id-16-bit"]
    outcome = run_case(PAST_2_16, TorchReference(), [mutant], device).results[0]
    assert "page 65536 read as 0" in outcome.comparison.diagnosis[0]


def test_correct_output_gets_no_diagnosis(device: torch.device) -> None:
    outcome = run_case(CASE, TorchReference(), [TritonUnifiedAttention()], device).results[0]
    assert outcome.status is Status.AGREE
    assert outcome.comparison.diagnosis == ()
    assert "Diagnosis" not in outcome.comparison.message(CASE)


def _diagnose(output: torch.Tensor, rows: tuple[int, ...]) -> list[str]:
    inputs = RunInputs(CASE, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    tolerance = Tolerance(backend.precision(CASE, inputs.device))
    return diagnose(inputs, output, truth, rows, tolerance, backend.empty_row_output(CASE))


def test_the_correct_output_itself_is_explained_by_nothing() -> None:
    """Every hypothesis changes what a row reads, so none reproduces the correct rows."""
    truth = TorchReference().reference(RunInputs(CASE, torch.device("cpu")))
    lines = _diagnose(truth.output.to(torch.float16), (0, 1, 2, 3))
    assert len(lines) == 1 and lines[0].startswith(NOTHING), lines


def test_random_output_is_explained_by_nothing() -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (CASE.total_q, CASE.num_q_heads, CASE.head_dim)
    garbage = torch.randn(shape, generator=generator).to(torch.float16)
    lines = _diagnose(garbage, (0, 1, 2, 3))
    assert len(lines) == 1 and lines[0].startswith(f"{NOTHING} ("), lines
    assert lines[0].endswith("rewritten reads of rows 0, 1, 2, 3 tried)")


def test_cost_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_ROWS rows, each with at most MAX_VARIANTS_PER_ROW rewritten reads (two
    recomputations each, for fp8's two NaN decodings), plus the rules' agreeing rows."""
    calls = []
    recompute = diagnosis._RowModel.recompute

    def counted(self: diagnosis._RowModel, read: diagnosis.Read, **kwargs: bool) -> object:
        calls.append(read.query_row)
        return recompute(self, read, **kwargs)

    monkeypatch.setattr(diagnosis._RowModel, "recompute", counted)
    shape = (CASE.total_q, CASE.num_q_heads, CASE.head_dim)
    _diagnose(torch.ones(shape, dtype=torch.float16), (3, 2, 1, 0, 3, 2))
    assert 0 < len(calls) <= 2 * diagnosis.MAX_ROWS * (diagnosis.MAX_VARIANTS_PER_ROW + 1)
    assert set(calls) <= {0, 1, 2, 3}


def test_a_failing_diagnosis_is_a_line_not_an_error(device: torch.device,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("no cache today")

    monkeypatch.setattr(diagnosis._RowModel, "__init__", broken)
    outcome = run_case(CASE, TorchReference(), [MUTANTS["triton-unified!skip-scales"]],
                       device).results[0]
    assert outcome.status is Status.DISAGREE
    assert outcome.comparison.diagnosis == ("diagnosis failed: RuntimeError: no cache today",)


# Request 0 attends 300 tokens, request 1 a single one: softmax over one token is 1 whatever
# the scale, so a wrong scale leaves request 1's row agreeing.
ONE_TOKEN_ROW = Case(num_blocks=8, seq_lens=(300, 1), block_tables=((5, 1, 6), (2,)),
                     selections=((0, 1, 2), (0, -1, -1)), num_q_heads=4,
                     query_dtype="float16", kv_dtype="float8_e4m3fn", k_scale=0.5,
                     v_scale=2.0, softmax_scale=0.2, name="one-token-row")


def test_a_rule_that_keeps_the_agreeing_rows_agreeing_is_kept() -> None:
    """A kernel that uses the default softmax scale everywhere: its output is the
    hypothesis's prediction exactly, wrong on request 0's row and agreeing on request 1's.
    The agreeing row is checked as a prediction within tolerance, not as an error to explain
    (it has none), so the rule survives its control row and names the bug."""
    inputs = RunInputs(ONE_TOKEN_ROW, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    tolerance = Tolerance(backend.precision(ONE_TOKEN_ROW, inputs.device))
    model = diagnosis._RowModel(inputs, tolerance, backend.empty_row_output(ONE_TOKEN_ROW))
    default = ONE_TOKEN_ROW.head_dim ** -0.5
    actual = torch.cat([model.recompute(dataclasses.replace(
        model.base(n), softmax_scale=default)).output for n in range(ONE_TOKEN_ROW.total_q)])
    assert diagnosis._agreeing_rows(actual, truth, tolerance) == [1]
    lines = diagnose(inputs, actual, truth, (0,), tolerance,
                     backend.empty_row_output(ONE_TOKEN_ROW))
    assert hypothesis_of(lines[0]) == "softmax-scale-default", lines
    assert "1 agreeing row" in lines[0] or "row 1" in lines[0], lines


# Prefill-like requests of 2 and 3 query tokens: rows 0-1 are request 0, rows 2-4 request 1.
PREFILL = Case(num_blocks=8, seq_lens=(300, 200), block_tables=((5, 1, 6), (2, 7)),
               selections=((0, 1, 2), (0, 1, 2), (0, 1, -1), (0, 1, -1), (0, 1, -1)),
               query_lens=(2, 3), num_q_heads=4, query_dtype="float16",
               kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, name="prefill")


def test_query_lens_rows_are_read_within_their_own_request() -> None:
    """The other-query-token hypotheses of row 3 try rows 4 and 2 (its request's last token
    first, then its first: query tokens 2 and 0), not rows of request 0 as
    ``request * decode_query_len`` arithmetic would."""
    inputs = RunInputs(PREFILL, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    model = diagnosis._RowModel(inputs, Tolerance(backend.precision(PREFILL, inputs.device)),
                                backend.empty_row_output(PREFILL))
    texts = [v.text for v in diagnosis._other_query_token(model, 3, model.base(3))
             if v.hypothesis == "other-query-token-selection"]
    assert texts == ["row 3 read what row 4 (query token 2 of its request) selects",
                     "row 3 read what row 2 (query token 0 of its request) selects"]


def test_query_lens_worst_locations_name_the_query_token_and_features_the_length() -> None:
    """A wrong row 4 is request 1's query token 2 (not token 0), and the case's features say
    its longest request has 3 query tokens."""
    inputs = RunInputs(PREFILL, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    actual = truth.output.clone()
    actual[4] += 1.0
    comparison = compare("broken", actual.to(torch.float16), truth,
                         Tolerance(backend.precision(PREFILL, inputs.device)),
                         backend.empty_row_output(PREFILL), PREFILL, inputs.rows)
    (worst,) = comparison.worst
    assert (worst.row, worst.request, worst.query_token) == (4, 1, 2)
    assert case_features(PREFILL)["decode_query_len"] == 3


def test_an_exact_output_under_a_zero_bound_has_error_over_tolerance_0(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the error and the bound are both 0 the ratio is 0, not 0/0 = NaN."""
    inputs = RunInputs(CASE, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    monkeypatch.setattr(Tolerance, "bound", lambda self, ref: torch.zeros_like(ref.output))
    comparison = compare("exact", truth.output.clone(), truth,
                         Tolerance(backend.precision(CASE, inputs.device)),
                         backend.empty_row_output(CASE), CASE, inputs.rows)
    assert comparison.agrees and comparison.max_ratio == 0.0


def test_a_rule_reading_canaries_does_not_pass_for_an_agreeing_row(device: torch.device) -> None:
    """``read-unselected-page`` on CASE: row 0 reads one canary page (all NaN), rows 1-3 agree.
    Every page-id rule makes rows 1-3 read canaries too; decoded as e4m3fn's 480 its
    prediction's tolerance admits any row, so an agreeing row is judged by whether the
    prediction itself agrees with the truth: none does, and without a rerun the per-row
    hypothesis is named."""
    mutant = MUTANTS["triton-unified!read-unselected-page"]
    inputs = RunInputs(CASE, device)
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    actual = mutant.run(inputs)
    assert not bool(torch.isfinite(actual[0]).any()) and bool(torch.isfinite(actual[1:]).all())
    lines = diagnose(inputs, actual, truth, (0,), Tolerance(backend.precision(CASE, device)),
                     backend.empty_row_output(CASE))
    assert hypothesis_of(lines[0]) == "page-from-unattended-block", lines


def test_finite_canaries_fill_each_page_alike_in_both_orders() -> None:
    """Every NaN of the plain and the shuffled cache becomes a finite value, one per page and
    the same in both orders; every other byte is kept; pages differ."""
    inputs = RunInputs(CASE, torch.device("cpu"))
    probe = diagnosis.finite_canaries(inputs, ("shuffled",))
    width = CASE.page_size * CASE.num_kv_heads * CASE.head_dim
    before = {o: inputs.cache(o).raw.view(-1, width).float() for o in ("plain", "shuffled")}
    after = {o: probe.cache(o).raw.view(-1, width).float() for o in ("plain", "shuffled")}
    for order in ("plain", "shuffled"):
        assert bool(torch.isfinite(after[order]).all())
        kept = ~before[order].isnan()
        assert torch.equal(after[order][kept], before[order][kept])
        assert bool(before[order].isnan().any())
    nan = before["plain"].isnan()
    assert torch.equal(nan.sum(1), before["shuffled"].isnan().sum(1))
    filled = torch.where(nan, after["plain"], float("nan")).nanmean(1)
    shuffled = torch.where(before["shuffled"].isnan(), after["shuffled"], float("nan")).nanmean(1)
    assert torch.equal(filled.nan_to_num(), shuffled.nan_to_num())
    canary_pages = filled[nan.all(1)]
    assert canary_pages.unique().numel() > canary_pages.numel() // 2
    assert probe.cache("plain").raw is not inputs.cache("plain").raw


def test_a_kernel_that_weights_canaries_by_zero_is_named() -> None:
    """Rows that are NaN on the canaries and right once the canaries are finite: the kernel
    loads slots no row attends and multiplies them by zero."""
    inputs = RunInputs(CASE, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    actual = truth.output.to(torch.float16)
    actual[0] = float("nan")
    runs = []

    def rerun(probe: RunInputs) -> torch.Tensor:
        runs.append(probe)
        return truth.output.to(torch.float16)

    lines = diagnose(inputs, actual, truth, (0,), Tolerance(backend.precision(CASE, inputs.device)),
                     backend.empty_row_output(CASE), diagnosis.Rerun(rerun, ("plain",)))
    assert hypothesis_of(lines[0]) == "canary-weighted-by-zero", lines
    assert len(runs) == 1 and bool(torch.isfinite(runs[0].cache("plain").raw.float()).all())


def test_a_failing_rerun_leaves_the_first_diagnosis(device: torch.device) -> None:
    def broken(probe: RunInputs) -> torch.Tensor:
        raise RuntimeError("no second run")

    mutant = MUTANTS["triton-unified!read-unselected-page"]
    inputs = RunInputs(CASE, device)
    backend = TritonUnifiedAttention()
    actual = mutant.run(inputs)
    lines = diagnose(inputs, actual, TorchReference().reference(inputs), (0,),
                     Tolerance(backend.precision(CASE, device)), backend.empty_row_output(CASE),
                     diagnosis.Rerun(broken, ("plain",)))
    assert hypothesis_of(lines[0]) == "page-from-unattended-block", lines
    assert "rerun" not in lines[0]


# Request 0's row attends only its last block, of 1 token (token 128); request 1's row
# attends 200 tokens, its last block holding 72.
ONE_TOKEN_BLOCK = Case(num_blocks=8, seq_lens=(129, 200), block_tables=((5, 1), (2, 7)),
                       selections=((1, -1), (0, 1)), num_q_heads=4, query_dtype="float16",
                       kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0,
                       name="one-token-block")


def test_a_read_two_hypotheses_make_credits_both() -> None:
    """Dropping a last block of one token is reading one token fewer: that read is
    recomputed once and credited to both, so the hypothesis that explains every row
    (the dropped block) is named first."""
    inputs = RunInputs(ONE_TOKEN_BLOCK, torch.device("cpu"))
    backend = TritonUnifiedAttention()
    truth = TorchReference().reference(inputs)
    tolerance = Tolerance(backend.precision(ONE_TOKEN_BLOCK, inputs.device))
    model = diagnosis._RowModel(inputs, tolerance, backend.empty_row_output(ONE_TOKEN_BLOCK))
    actual = torch.cat([model.recompute(dataclasses.replace(
        model.base(n), context_len=model.base(n).context_len - row.segments[-1].tokens)).output
        for n, row in enumerate(inputs.rows)])
    lines = diagnose(inputs, actual, truth, (0, 1), tolerance,
                     backend.empty_row_output(ONE_TOKEN_BLOCK))
    assert lines[0].startswith(f"{diagnosis.PREFIX}last-block-dropped ("), lines
    assert "all 2 diagnosed rows" in lines[0]
    assert any(line.startswith("partly explained by: context-minus-1") for line in lines)
