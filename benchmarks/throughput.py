"""Cases per second, and where the time goes, at small and production decode shapes.

    python -m benchmarks.throughput --shape production --device cuda --cases 5
    python -m benchmarks.throughput --shape small --device cpu --cases 20

Production: 16 query heads per rank, 1 KV head, top-k 16, 128 requests of 64 blocks, fp8
KV, a 55k-block cache. Stages: generation (data, rows, page table), cache build per in-page
order, each backend (``torch-ref`` is the float64 reference), comparison. "framework" is
generation + cache build + comparison; "backends" is the sum of the backends' own time.
The first case is a warm-up (Triton compilation) and is not counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

from difftest.case import Case
from difftest.session import Session

FRAMEWORK_STAGES = ("generate", "cache:plain", "cache:shuffled", "compare")


def production_case(seed: int, num_blocks: int = 55_000, batch: int = 128, topk: int = 16,
                    blocks_per_request: int = 64, query_dtype: str = "bfloat16",
                    kv_dtype: str = "float8_e4m3fn") -> Case:
    """A decode step at production shape, with indexer-style selections."""
    rng = random.Random(seed)
    physical = rng.sample(range(num_blocks), batch * blocks_per_request)
    seq_lens, tables, selections = [], [], []
    for r in range(batch):
        seq_len = blocks_per_request * 128 - rng.randrange(128)
        self_blk = (seq_len - 1) // 128
        tables.append(tuple(physical[r * blocks_per_request:(r + 1) * blocks_per_request]))
        seq_lens.append(seq_len)
        others = rng.sample(range(1, self_blk), topk - 2)
        selections.append((0, self_blk, *others))
    return Case(num_blocks=num_blocks, seq_lens=tuple(seq_lens), block_tables=tuple(tables),
                selections=tuple(selections), query_dtype=query_dtype, kv_dtype=kv_dtype,
                k_scale=0.05, v_scale=0.02, seed=seed, name=f"production-{seed}")


def small_case(seed: int, query_dtype: str) -> Case:
    """The corpus-sized case: 2 requests, top-k 16, 128 blocks."""
    return production_case(seed, num_blocks=128, batch=2, blocks_per_request=20,
                           query_dtype=query_dtype).replace(name=f"small-{seed}")


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("small", "production"), default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cases", type=int, default=5)
    parser.add_argument("--backends", default="triton-unified")
    parser.add_argument("--query-dtype", default=None,
                        help="default: bfloat16 on GPUs, float16 on the CPU (docs/findings.md F1)")
    args = parser.parse_args()
    session = Session.create(args.backends.split(","), device=args.device)
    q_dtype = args.query_dtype or ("bfloat16" if session.device.type == "cuda" else "float16")
    make = ((lambda s: production_case(s, query_dtype=q_dtype)) if args.shape == "production"
            else (lambda s: small_case(s, q_dtype)))
    stages: dict[str, list[float]] = defaultdict(list)
    walls = []
    for seed in range(args.cases + 1):
        case = make(seed)
        start = time.perf_counter()
        result = session.run(case)
        wall = time.perf_counter() - start
        statuses = {r.backend: r.status.value for r in result.results}
        print(f"case {seed}: {wall:.3f} s  {statuses}", flush=True)
        if seed == 0:
            continue
        walls.append(wall)
        for stage, seconds in result.timings.items():
            stages[stage].append(seconds)
    framework = sum(statistics.mean(stages[s]) for s in FRAMEWORK_STAGES if s in stages)
    backends = sum(statistics.mean(v) for k, v in stages.items() if k not in FRAMEWORK_STAGES)
    print(f"\nshape {args.shape}, device {session.device}, {args.cases} timed cases, "
          f"query {q_dtype}")
    print(f"{'stage':<24}{'mean ms':>12}")
    for stage, values in sorted(stages.items()):
        print(f"{stage:<24}{1e3 * statistics.mean(values):>12.2f}")
    print(f"{'framework':<24}{1e3 * framework:>12.2f}")
    print(f"{'backends':<24}{1e3 * backends:>12.2f}")
    print(f"cases per second: {len(walls) / sum(walls):.3f}")


if __name__ == "__main__":
    main()
