"""``python -m cupynce``: the self-check against the float64 oracle and the benchmark report.

=============  ==========================================================================
cli.py         the command line (``check``, ``bench``, options)
runner.py      runs the checks and the benchmark, writes results.json and summary.md
ops.py         what the report runs per op: shapes, inputs, the oracle, the PyTorch formula,
               the peers, the tolerances
harness.py     timing (CUDA events, medians and quantiles), peak memory, device and version
               info, tables; shared with ``benchmarks/``
plots.py       the PNG plots (matplotlib, the ``report`` extra)
=============  ==========================================================================
"""
from .runner import run

__all__ = ["run"]
