"""cupynce's cuBLAS binding (``_engine.blas``) on a machine without a GPU: the fallback to
CuPy's wrappers when cuBLAS cannot be reached through ctypes."""
from __future__ import annotations

import pytest


def test_cublas_binding_falls_back_to_cupy(monkeypatch):
    """Without a ctypes-reachable cuBLAS the products use CuPy's wrappers (one warning),
    and binding a capture stream is a no-op (the capture is then refused, not broken)."""
    from cupynce._engine import blas

    def missing():
        raise OSError("libcublas.so.99: cannot open shared object file")

    monkeypatch.setattr(blas, "_LIB", None)
    monkeypatch.setattr(blas, "_libcublas", missing)
    with pytest.warns(RuntimeWarning, match="CuPy's cuBLAS wrappers"):
        assert blas._ctypes_ok() is False
    assert blas._ctypes_ok() is False  # decided once
    blas.bind_stream()  # no handle, no error
