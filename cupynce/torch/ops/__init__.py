"""One module per op of ``cupynce.torch``, mirroring ``cupynce.ops``: the op bodies on tensors
(one core call each), their FakeTensor shapes, ``setup_context`` / ``backward``, the eager
``autograd.Function``, the registered custom ops (``cupynce::<op>_fwd`` / ``_bwd``) and the
public function.  The functions are re-exported by :mod:`cupynce.torch`.
"""
