"""The differential suite, installed with difftest: ``pytest -n 4 --pyargs difftest.kernel_tests``.

It runs the pinned corpus and generated cases on this machine's kernels (every registered
backend, or ``--difftest-backends``), one GPU per xdist worker, without a checkout. Naming it
on the command line activates difftest as a ``--difftest-*`` option does
(:mod:`difftest.pytest_plugin`): GPU pinning, Hypothesis profiles, failure artifacts, and the
report with ``--difftest-report``. difftest's own self-tests are the checkout's ``tests/``.
"""
