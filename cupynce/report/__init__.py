"""``python -m cupynce``: the self-check against the float64 oracle and the benchmark report.

=================  ======================================================================
cli.py             the command line (``check``, ``bench``, options)
runner.py          runs the checks and the benchmark, writes results.json and summary.md
ops.py             what the report runs per op: shapes, inputs, the oracle, the PyTorch
                   formula, the peers, the tolerances
harness.py         one measured case (first call, peak memory, times; OOM as a result), and
                   every name below for ``benchmarks/``, which shares it
timing.py          CUDA-event and host timing, medians and quantiles, the SM clock
memory.py          peak memory above the baseline (CuPy's pool, torch, the host)
environment.py     the GPU, CUDA and package versions, the date
formatting.py      table cells (ms, MiB, ratios), markdown tables
torch_baseline.py  the PyTorch formulas users run today, arrays as tensors, a training step
progress.py        the progress bar on stderr
plots.py           the PNG plots (matplotlib, the ``report`` extra)
=================  ======================================================================
"""
from .runner import run

__all__ = ["run"]
