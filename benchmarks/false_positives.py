"""False positives: correct backends on a long stretch of fitted examples, per profile.

    python -m benchmarks.false_positives --examples 2000 --workers 2 --json fp.json
    python -m benchmarks.false_positives --examples 100 --backends triton-unified
    python -m benchmarks.false_positives --profiles dev,nightly --examples 2000
    python -m benchmarks.false_positives --family dense --examples 2000 --json fp-dense.json

``--profiles`` says how the examples are searched: ``derandomized`` (the default) draws
``difftest run``'s fixed set; ``dev`` and ``nightly`` search as ``pytest
tests/test_differential.py`` does under those Hypothesis profiles (their settings, with each
backend's error/tolerance as a ``target``, which steers the search toward the cases closest
to the tolerance: where a false positive would be), each part under ``@seed(seed + i)`` so a
stretch can be rerun.

The examples are what ``difftest run`` draws (:class:`difftest.cases.capabilities.
Capabilities`: every dtype combination and kernel mode some chosen backend runs, each example
fitted to every backend), with a smaller geometry by default (``--max-batch 2 --max-topk 4``)
so that thousands fit in minutes. They are drawn in ``--parts`` parts, part ``i`` under seed
``seed + i``, each drawn and run by one worker process: the set depends on the examples, the
parts and the seed, never on the number of workers. Every backend is correct, so any
disagreement, error or crash is a false positive: it is printed with its case JSON and the
exit status is 1. The parameter audit of the stretch (:mod:`difftest.audit`) is printed too,
and its blind spots (an argument a backend accepts that took a single value) also fail the run.
``--family dense`` draws the dense family instead (:mod:`difftest.cases.dense`, its own small
geometry; ``--max-batch`` and ``--max-topk`` do not apply).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from difftest import devices
from difftest.registry import split_names

DEFAULT_BACKENDS = ("triton-unified", "vllm-triton-sparse", "aiter-gluon@emulated",
                    "vllm-aiter@emulated")


def _prepare_worker(device: str, workers: int) -> None:
    devices.prepare_runtime(device)
    devices.share_cpu_threads(workers)


def run_part(examples: int, seed: int, names: Sequence[str], device: str, max_batch: int,
             max_topk: int, profile: str = "derandomized", family: str = "sparse"
             ) -> dict[str, Any]:
    """Draw ``examples`` examples under ``seed`` as ``profile`` searches (module docstring),
    fit them to the backends called ``names`` and run every fitted case: the records (as
    dicts), the failures and generation's summary."""
    import tempfile

    import torch

    from difftest.cases.capabilities import Capabilities
    from difftest.cases.generate import generated_cases
    from difftest.runner import FAILING
    from difftest.session import Session

    with tempfile.TemporaryDirectory() as artifacts:
        session = Session.create(list(names), device=device, artifacts=artifacts)
        capabilities = Capabilities.probe(session.backends, torch.device(device))
        strategy = (capabilities.dense_strategy() if family == "dense" else
                    capabilities.strategy(max_batch=max_batch, max_topk=max_topk))
        failures: list[dict[str, Any]] = []

        def run(fitted: Any) -> list[tuple[str, float]]:
            result = session.run(fitted.case, fitted.backends)
            failed = [r for r in result.results if r.status in FAILING]
            failures.extend({"backend": r.backend, "status": r.status.value,
                             "case": fitted.case.to_dict(), "message": message,
                             "profile": profile}
                            for r, message in zip(failed, result.failure_messages(),
                                                  strict=True))
            return [(r.backend, r.comparison.max_ratio) for r in result.results
                    if r.comparison is not None]

        start = time.perf_counter()
        if profile == "derandomized":
            runs = capabilities.fit_all(generated_cases(examples, seed, strategy))
            drawn_seconds = time.perf_counter() - start
            for fitted in runs:
                run(fitted)
        else:
            _search(profile, examples, seed, strategy, capabilities, run)
            drawn_seconds = 0.0  # drawn between the runs
        return {"records": [r.to_dict() for r in session.records], "failures": failures,
                "lines": capabilities.lines(), "examples": capabilities.examples,
                "unfit": capabilities.examples_unfit, "drawn_seconds": drawn_seconds,
                "profile": profile}


def _search(profile: str, examples: int, seed: int, strategy: Any, capabilities: Any,
            run: Any) -> None:
    """``tests/test_differential.py``'s search under the ``difftest-<profile>`` settings
    (``examples`` examples, no example database, ``@seed(seed)``): each example fitted and
    run, each backend's error/tolerance targeted."""
    import math

    from hypothesis import given, target
    from hypothesis import seed as hypothesis_seed
    from hypothesis import settings as hypothesis_settings

    from difftest._pytest_run import register_profiles

    register_profiles()

    @hypothesis_seed(seed)
    @hypothesis_settings(hypothesis_settings.get_profile(f"difftest-{profile}"),
                         max_examples=examples, database=None)
    @given(strategy)
    def search(case: Any) -> None:
        for fitted in capabilities.fit_all([case]):
            for backend, ratio in run(fitted):
                if math.isfinite(ratio):
                    target(ratio, label=f"error/tolerance {backend}")

    search()


PROFILES = ("derandomized", "dev", "nightly")


def _profiles(text: str) -> list[str]:
    """argparse type: comma-separated profile names."""
    names = [n for n in text.split(",") if n]
    wrong = [n for n in names if n not in PROFILES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed {', '.join(PROFILES)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stretch; exit 1 on any false positive or blind spot."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.false_positives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=int, default=16,
                        help="draw the examples in this many parts, part i under seed + i")
    parser.add_argument("--backends", type=split_names, default=list(DEFAULT_BACKENDS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--max-topk", type=int, default=4)
    parser.add_argument("--profiles", type=_profiles, default=["derandomized"],
                        help="comma-separated: derandomized, dev, nightly (module docstring)")
    parser.add_argument("--family", choices=("sparse", "dense"), default="sparse",
                        help="the case family drawn (default: sparse)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = devices.resolve(args.device)
    devices.prepare_runtime(device)
    import torch

    from difftest.audit import audit_lines, blind_spots
    from difftest.registry import discover, select

    # resolved before the hour of work, from the code the workers will import
    backends = [b for b in select(discover(), args.backends) if b.availability().available]
    start = time.perf_counter()
    sizes = [len(range(i, args.examples, args.parts)) for i in range(args.parts)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context,
                                                initializer=_prepare_worker,
                                                initargs=(device, args.workers)) as pool:
        futures = [pool.submit(run_part, size, args.seed + i, args.backends, device,
                               args.max_batch, args.max_topk, profile, args.family)
                   for profile in args.profiles for i, size in enumerate(sizes) if size]
        parts = []
        for future in futures:  # each part on disk as it ends: a late failure loses nothing
            parts.append(future.result())
            if args.json:
                with open(f"{args.json}.parts", "a") as log:
                    log.write(json.dumps(parts[-1]) + "\n")
    wall = time.perf_counter() - start

    records = [r for part in parts for r in part["records"]]
    failures = [f for part in parts for f in part["failures"]]
    examples = sum(part["examples"] for part in parts)
    unfit = sum(part["unfit"] for part in parts)
    statuses = Counter((r["backend"], r["status"]) for e in records for r in e["results"])
    names = sorted({backend for backend, _ in statuses})
    per_profile = Counter((part["profile"], r["backend"], r["status"]) for part in parts
                          for e in part["records"] for r in e["results"])
    found = Counter((f["profile"], f["backend"]) for f in failures)
    blind = [f"{c.backend}: {c.argument}" for c in blind_spots(records, backends)]
    generation = [f"{part['profile']} part {i % args.parts + 1} (seed "
                  f"{args.seed + i % args.parts}): {line}"
                  for i, part in enumerate(parts) for line in part["lines"]]
    generation.append(f"examples some backend could not run, all parts: {unfit} of {examples} "
                      f"({unfit / max(examples, 1):.1%})")
    for line in generation:
        print(f"generation: {line}")
    print("\n".join(audit_lines(records, backends)))
    print(f"{'profile':<13} {'backend':<24} {'runs':>6} {'agree':>6} {'unsupp.':>7} "
          f"{'false positives':>15}")
    for profile in args.profiles:
        for backend in names:
            count = {s: n for (p, b, s), n in per_profile.items() if (p, b) == (profile, backend)}
            print(f"{profile:<13} {backend:<24} {sum(count.values()):>6} "
                  f"{count.get('agree', 0):>6} {count.get('unsupported', 0):>7} "
                  f"{found[profile, backend]:>15}")
    by_profile: Counter[str] = Counter()
    for part in parts:
        by_profile[part["profile"]] += part["examples"]
    for failure in failures:
        print(f"FALSE POSITIVE {failure['backend']} {failure['status']}: "
              f"{json.dumps(failure['case'], sort_keys=True)}\n{failure['message']}")
    print(f"blind spots: {', '.join(blind) or 'none'}")
    print(f"{len(failures)} false positives in {examples} examples ("
          f"{', '.join(f'{p} {n}' for p, n in by_profile.items())}; {args.family} family) "
          f"({len(records)} fitted runs; {args.parts} parts from seed {args.seed}; max batch "
          f"{args.max_batch}, max top-k {args.max_topk}) on {', '.join(names)}; drawing "
          f"{sum(p['drawn_seconds'] for p in parts):.0f} s summed over parts, wall {wall:.0f} s "
          f"on {device} ({os.cpu_count()} cores, {args.workers} workers, "
          f"{platform.platform()}, Python {platform.python_version()}, torch "
          f"{torch.__version__})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"examples": examples, "family": args.family, "parts": args.parts,
                       "seed": args.seed,
                       "profiles": {p: {b: {s: n for (q, c, s), n in per_profile.items()
                                            if (q, c) == (p, b)} for b in names}
                                    for p in args.profiles},
                       "runs": len(records), "backends": names, "generation": generation,
                       "statuses": {f"{b} {s}": n for (b, s), n in sorted(statuses.items())},
                       "false_positives": failures, "blind_spots": blind,
                       "wall_seconds": wall, "command": " ".join(sys.argv)}, fh, indent=1)
    return 1 if failures or blind else 0


if __name__ == "__main__":
    sys.exit(main())
