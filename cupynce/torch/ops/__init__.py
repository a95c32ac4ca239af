"""One module per op of ``cupynce.torch``, mirroring ``cupynce.ops``: the op's table entry
(``_skeleton.Loss``; SPLADE's head: its own bodies and an ``_skeleton.Op``), from which its
op bodies on tensors (one core call each), their FakeTensor shapes, ``setup_context`` /
``backward``, the eager ``autograd.Function`` and the registered custom ops
(``cupynce::<op>_fwd`` / ``_bwd``) follow, and the public function.  The functions are
re-exported by :mod:`cupynce.torch`.
"""
