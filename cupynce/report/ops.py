"""The ops that ``python -m cupynce`` checks and benchmarks: one registry entry per op.

An entry (:class:`OpSpec`) says, for one op, how to make inputs, how to run cupynce's forward
and backward, the float64 oracle (:mod:`cupynce.reference`), the PyTorch formula users run
today (:func:`cupynce.report.torch_baseline.torch_reference`), the installed peers, the
shapes of the self-check and the sizes of the benchmark sweep.  :mod:`cupynce.report` only
loops over :data:`REGISTRY`; adding an op is one subclass and one :func:`register` call.

Every runner returns ``(out, grads)``: the loss (or, for SPLADE, the (B, V) output) and the
gradients of ``sum(grad * out)`` with respect to the inputs, in a fixed order
(:attr:`OpSpec.grad_names`).  Arrays are NumPy (NumPy path) or CuPy (kernels); nothing here
times or measures memory (that is :mod:`cupynce.report.harness`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import cupynce
from cupynce import reference as R
from cupynce._engine.kernels import BFLOAT16
from cupynce.report.torch_baseline import to_torch, torch_reference, torch_step

#: (loss / output, gradient) relative tolerances ``‖x − ref‖ / ‖ref‖`` against the float64
#: oracle, per dtype.  float32: the seeds' 1e-5 / 1e-4; half: what 16-bit gradient storage
#: and a 16-bit rounding of the output give on these shapes, with room (checked on the GPU).
TOLERANCES: Dict[str, Tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-4),
    "float16": (5e-3, 2e-2),
    "bfloat16": (2e-2, 5e-2),
}
DTYPES: Tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")

Step = Callable[[], Tuple[Any, Sequence[Any]]]


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        if BFLOAT16 is None:  # pragma: no cover - ml_dtypes is a dependency
            raise ValueError("bfloat16 needs ml_dtypes")
        return BFLOAT16
    return np.dtype(name)


def cast(xp, x, dtype: np.dtype):
    """``x.astype(dtype)``; through the host when CuPy cannot cast to it (bfloat16)."""
    try:
        return x.astype(dtype)
    except Exception:  # noqa: BLE001 - a CuPy without bfloat16 casts
        import cupy

        return cupy.asarray(cupy.asnumpy(x).astype(dtype))


def _unit_rows(xp, x):
    return x / xp.linalg.norm(x, axis=-1, keepdims=True)


def _pairs(xp, rows: int, d: int, seed: int):
    """Two float32 (rows, D) arrays of unit rows, row i of the second = normalise(first + noise).

    The positive pairs then have cosine ~ 1/sqrt(2), as embeddings a model has started to align
    (realistic logits; independent random rows give softmaxes that are nearly uniform).
    """
    rng = xp.random.default_rng(seed)
    x = _unit_rows(xp, rng.standard_normal((rows, d), dtype=xp.float32))
    noise = rng.standard_normal((rows, d), dtype=xp.float32) * np.float32(1.0 / math.sqrt(d))
    y = _unit_rows(xp, x + noise)
    return x, y


class OpSpec:
    """One op of the report.  Subclasses fill in the methods; see the module notes."""

    name: str = ""
    #: the shape entry that the benchmark sweeps, and its axis label
    size_key: str = "n"
    size_label: str = "N (rows)"
    #: names of the gradients returned by :meth:`run` and :meth:`oracle`, in order
    grad_names: Tuple[str, ...] = ()
    #: how many of those gradients the PyTorch reference returns (same order)
    description: str = ""

    def available(self) -> Optional[str]:
        """None when this cupynce has the op, else why it is skipped."""
        return None

    def params(self) -> Dict[str, Any]:
        """Fixed parameters (temperature, ...), recorded in results.json."""
        return {}

    # -- shapes ----------------------------------------------------------------------------
    def check_shapes(self, gpu: bool) -> List[Dict[str, Any]]:
        raise NotImplementedError

    def bench_shapes(self, mode: str, gpu: bool, sizes: Optional[Sequence[int]] = None,
                     dim: Optional[int] = None) -> List[Dict[str, Any]]:
        raise NotImplementedError

    def shape_text(self, shape: Dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in shape.items() if not isinstance(v, str))

    def oracle_bytes(self, shape: Dict[str, Any]) -> int:
        """About how much host memory the float64 oracle needs at ``shape``."""
        raise NotImplementedError

    # -- inputs and runners ----------------------------------------------------------------
    def inputs(self, xp, shape: Dict[str, Any], dtype: np.dtype, *, check: bool,
               seed: int = 0) -> Tuple[Any, ...]:
        raise NotImplementedError

    def grad(self, xp, shape: Dict[str, Any], dtype: np.dtype, *, check: bool) -> Any:
        """The upstream gradient: a scalar for the losses (0.5 in the self-check, not 1)."""
        return 0.5 if check else 1.0

    def run(self, inputs: Tuple[Any, ...], shape: Dict[str, Any], grad: Any, *,
            check: bool) -> Tuple[Any, List[Any]]:
        raise NotImplementedError

    def step(self, inputs, shape, grad, *, check: bool = False) -> Step:
        return lambda: self.run(inputs, shape, grad, check=check)

    def oracle(self, inputs: Tuple[Any, ...], shape: Dict[str, Any], grad: Any, *,
               check: bool) -> Tuple[Any, List[Any]]:
        raise NotImplementedError

    def torch_step(self, torch, inputs: Tuple[Any, ...], shape: Dict[str, Any], grad: Any,
                   *, dtype=None, compile: bool = False) -> Step:
        """The PyTorch formula on tensors holding the same bits (``dtype``: cast first)."""
        raise NotImplementedError

    def peers(self, torch, dtype_name: str) -> Dict[str, Any]:
        """``{name: builder or reason-string}``; a builder maps (torch, inputs, shape, grad)
        to a step.  Only on the GPU (the peers are Triton kernels)."""
        return {}


# ------------------------------------------------------------------------------------------
# the InfoNCE family
# ------------------------------------------------------------------------------------------
def _leaves(torch, inputs, dtype=None):
    out = []
    for x in inputs:
        t = to_torch(torch, x).clone()
        if dtype is not None:
            t = t.to(dtype)
        out.append(t.requires_grad_(True))
    return out


class _Contrastive(OpSpec):
    size_key = "n"
    size_label = "N (rows)"
    temperature = 0.1

    def params(self) -> Dict[str, Any]:
        return {"temperature": self.temperature, "check_normalize": True,
                "bench_normalize": False, "bench_inputs": "unit rows, positive cosine ~0.71"}

    def check_shapes(self, gpu: bool) -> List[Dict[str, Any]]:
        return [{"n": 64, "d": 32}, {"n": 1030, "d": 100}] if gpu else \
            [{"n": 16, "d": 8}, {"n": 130, "d": 33}]

    def bench_shapes(self, mode, gpu, sizes=None, dim=None):
        if sizes is None:
            if gpu:  # (the small sizes: a per-GPU batch of multi-GPU training)
                sizes = (256, 1024, 4096, 8192, 32768) if mode == "quick" else \
                    (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
            else:
                sizes = (64, 256, 1024) if mode == "quick" else \
                    (64, 128, 256, 512, 1024, 2048, 4096)
        d = dim or (512 if gpu else 64)
        return [{"n": int(n), "d": int(d)} for n in sizes]

    def shape_text(self, shape):
        s = f"N={shape['n']}, D={shape['d']}"
        return s + (f", M={shape['m']}" if shape.get("m") else "")

    def oracle_bytes(self, shape):
        n = shape["n"] + shape.get("m", 0)
        return 6 * shape["n"] * n * 8 + 8 * n * shape["d"] * 8


class NTXent(_Contrastive):
    name = "nt_xent"
    grad_names = ("dz",)
    description = "SimCLR NT-Xent, z (N, D) = two stacked views"

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        n, d = shape["n"], shape["d"]
        if check:
            rng = np.random.default_rng(seed)
            z = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(dtype)
            return (xp.asarray(z),)
        x, y = _pairs(xp, n // 2, d, seed)
        return (cast(xp, xp.concatenate([x, y]), dtype),)

    def run(self, inputs, shape, grad, *, check):
        loss, ctx = cupynce.nt_xent_forward(inputs[0], self.temperature, normalize=check)
        return loss, [cupynce.nt_xent_backward(ctx, grad)]

    def oracle(self, inputs, shape, grad, *, check):
        loss, grads = R.nt_xent(inputs[0], self.temperature, normalize=check, grad_loss=grad)
        return loss, list(grads)

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "nt_xent", self.temperature)
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn,
                          _leaves(torch, inputs, dtype))


class InfoNCE(_Contrastive):
    name = "info_nce"
    grad_names = ("dquery", "dkey", "dnegatives")
    description = "query/key InfoNCE, in-batch negatives (+ shared negatives in the check)"

    def check_shapes(self, gpu):
        shapes = super().check_shapes(gpu)
        shapes[1]["m"] = 37 if gpu else 7  # explicit shared negatives, (M, D)
        return shapes

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        n, d, m = shape["n"], shape["d"], shape.get("m", 0)
        if check:
            rng = np.random.default_rng(seed)
            arrs = [(rng.standard_normal((r, d)) / np.sqrt(d)).astype(dtype)
                    for r in (n, n, m) if r]
            return tuple(xp.asarray(a) for a in arrs)
        q, k = _pairs(xp, n, d, seed)
        return cast(xp, q, dtype), cast(xp, k, dtype)

    def run(self, inputs, shape, grad, *, check):
        neg = inputs[2] if len(inputs) > 2 else None
        loss, ctx = cupynce.info_nce_forward(inputs[0], inputs[1], self.temperature,
                                             negatives=neg, normalize=check)
        dq, dk, dn = cupynce.info_nce_backward(ctx, grad)
        return loss, [g for g in (dq, dk, dn) if g is not None]

    def oracle(self, inputs, shape, grad, *, check):
        neg = inputs[2] if len(inputs) > 2 else None
        loss, grads = R.info_nce(inputs[0], inputs[1], self.temperature, negatives=neg,
                                 normalize=check, grad_loss=grad)
        return loss, [g for g in grads if g is not None]

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "info_nce", self.temperature)
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn,
                          _leaves(torch, inputs[:2], dtype))


class SupCon(_Contrastive):
    name = "supcon_loss"
    grad_names = ("dz",)
    description = "supervised contrastive (SupCon), z (N, D), four views a class"

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        n, d = shape["n"], shape["d"]
        # (view-major: row i's class i mod N/4, so the bench pairs below share a class)
        labels = xp.asarray(np.arange(n, dtype=np.int64) % max(1, n // 4))
        if check:
            rng = np.random.default_rng(seed)
            z = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(dtype)
            return xp.asarray(z), labels
        x, y = _pairs(xp, -(-n // 2), d, seed)
        return cast(xp, xp.concatenate([x, y])[:n], dtype), labels

    def run(self, inputs, shape, grad, *, check):
        loss, ctx = cupynce.supcon_forward(inputs[0], inputs[1], self.temperature,
                                           normalize=check)
        return loss, [cupynce.supcon_backward(ctx, grad)]

    def oracle(self, inputs, shape, grad, *, check):
        loss, grads = R.supcon_loss(inputs[0], inputs[1], self.temperature, normalize=check,
                                    grad_loss=grad)
        return loss, list(grads)

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "supcon_loss", self.temperature)
        labels = to_torch(torch, inputs[1])
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn,
                          _leaves(torch, inputs[:1], dtype), extra=(labels,))


class ClipLoss(_Contrastive):
    name = "clip_loss"
    grad_names = ("da", "db", "dlogit_scale")
    description = "CLIP symmetric loss, learnable logit_scale = log(1/0.07)"
    logit_scale = math.log(1 / 0.07)

    def params(self):
        p = super().params()
        del p["temperature"]
        p["logit_scale"] = self.logit_scale
        return p

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        n, d = shape["n"], shape["d"]
        acc = np.float64 if dtype == np.float64 else np.float32
        ls = xp.asarray(np.asarray(self.logit_scale, acc))  # 0-d: its gradient is checked too
        if check:
            rng = np.random.default_rng(seed)
            a, b = ((rng.standard_normal((n, d)) / np.sqrt(d)).astype(dtype) for _ in range(2))
            return xp.asarray(a), xp.asarray(b), ls
        a, b = _pairs(xp, n, d, seed)
        return cast(xp, a, dtype), cast(xp, b, dtype), ls

    def run(self, inputs, shape, grad, *, check):
        loss, ctx = cupynce.clip_loss_forward(inputs[0], inputs[1], inputs[2], normalize=check)
        return loss, list(cupynce.clip_loss_backward(ctx, grad))

    def oracle(self, inputs, shape, grad, *, check):
        loss, grads = R.clip_loss(inputs[0], inputs[1], inputs[2], normalize=check,
                                  grad_loss=grad)
        return loss, list(grads)

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "clip_loss")
        leaves = _leaves(torch, inputs[:2], dtype)
        ls = _leaves(torch, inputs[2:], torch.float64 if dtype == torch.float64 else None)
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn,
                          leaves + ls)

    def peers(self, torch, dtype_name):
        out: Dict[str, Any] = {}
        try:
            import memeff  # noqa: F401
            out["memeff"] = _memeff_builder
        except Exception as exc:  # noqa: BLE001 - not installed, or its Triton fails to import
            out["memeff"] = f"not available ({type(exc).__name__}: {exc})"[:200]
        try:
            import inf_cl  # noqa: F401
            out["inf_cl"] = _inf_cl_builder
        except Exception as exc:  # noqa: BLE001
            out["inf_cl"] = f"not available ({type(exc).__name__}: {exc})"[:200]
        return out


class SigLip(_Contrastive):
    name = "siglip_loss"
    grad_names = ("da", "db", "dlogit_scale", "dlogit_bias")
    description = "SigLIP sigmoid loss, learnable logit_scale = log 10 and logit_bias = -10"
    logit_scale = math.log(10.0)
    logit_bias = -10.0

    def params(self):
        p = super().params()
        del p["temperature"]
        p["logit_scale"], p["logit_bias"] = self.logit_scale, self.logit_bias
        return p

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        acc = np.float64 if dtype == np.float64 else np.float32
        a, b, ls = ClipLoss.inputs(self, xp, shape, dtype, check=check, seed=seed)
        ls = xp.asarray(np.asarray(self.logit_scale, acc))  # 0-d: gradients checked too
        return a, b, ls, xp.asarray(np.asarray(self.logit_bias, acc))

    def run(self, inputs, shape, grad, *, check):
        loss, ctx = cupynce.siglip_loss_forward(*inputs, normalize=check)
        return loss, list(cupynce.siglip_loss_backward(ctx, grad))

    def oracle(self, inputs, shape, grad, *, check):
        loss, grads = R.siglip_loss(*inputs, normalize=check, grad_loss=grad)
        return loss, list(grads)

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "siglip_loss")
        leaves = _leaves(torch, inputs[:2], dtype)
        scalars = _leaves(torch, inputs[2:], torch.float64 if dtype == torch.float64 else None)
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn,
                          leaves + scalars)


def _memeff_builder(torch, inputs, shape, grad) -> Step:
    """memeff 0.3's fused Triton CLIP loss: fixed temperature (no logit_scale gradient)."""
    import memeff

    a, b = _leaves(torch, inputs[:2])
    temperature = math.exp(-ClipLoss.logit_scale)
    loss_fn = memeff.MemoryEfficientCLIPLoss(temperature=temperature, normalized_inputs=True,
                                             stable=False)

    def step():
        loss = loss_fn(a, b)
        return loss, torch.autograd.grad(loss, (a, b))
    return step


def _inf_cl_builder(torch, inputs, shape, grad) -> Step:
    """Inf-CL's flash loss, one call per direction (its scale gets no gradient outside
    torch.distributed)."""
    from inf_cl import cal_inf_loss

    a, b = _leaves(torch, inputs[:2])
    scale = torch.tensor(math.exp(ClipLoss.logit_scale), device=a.device, dtype=torch.float32)
    d = a.shape[1]
    head_dim = next((h for h in (256, 128, 64, 32, 16) if d % h == 0), 256)

    def step():
        loss = (cal_inf_loss(a, b, scale=scale, head_dim=head_dim)
                + cal_inf_loss(b, a, scale=scale, head_dim=head_dim)) / 2
        return loss, torch.autograd.grad(loss, (a, b))
    return step


# ------------------------------------------------------------------------------------------
# SPLADE (registered only when this cupynce has it)
# ------------------------------------------------------------------------------------------
class SpladePool(OpSpec):
    name = "splade_pool"
    size_key = "v"
    size_label = "V (vocabulary)"
    grad_names = ("dx", "dweight", "dbias")
    description = "SPLADE head max_l log(1 + relu(x Wᵀ + b)), masked, (B, V) output"

    def available(self):
        if not hasattr(cupynce, "splade_pool_forward"):
            return "this cupynce has no splade_pool"
        if not hasattr(R, "splade_pool"):
            return "cupynce.reference has no splade_pool"
        return None

    def params(self):
        return {"check_inputs": "multiples of 1/4 (exact logits: the max is the oracle's in "
                                "every dtype)", "bench_activation": "log1p_relu",
                "mask": "a random quarter of the positions masked, one row all masked"}

    def check_shapes(self, gpu):
        return [{"b": 3, "l": 17, "d": 40, "v": 130, "activation": "log1p_relu"},
                {"b": 5, "l": 64, "d": 96, "v": 1030, "activation": "relu"}]

    def bench_shapes(self, mode, gpu, sizes=None, dim=None):
        if gpu:
            b, l, d = (32, 128, 768) if mode == "quick" else (32, 256, 768)
            sizes = sizes or ((4096, 30522, 105879) if mode == "quick" else
                              (1024, 4096, 30522, 105879, 250002))
        else:
            b, l, d = 4, 16, 32
            sizes = sizes or ((256, 1024, 4096) if mode == "quick" else
                              (256, 1024, 4096, 16384))
        return [{"b": b, "l": l, "d": dim or d, "v": int(v), "activation": "log1p_relu"}
                for v in sizes]

    def shape_text(self, shape):
        return f"B={shape['b']}, L={shape['l']}, D={shape['d']}, V={shape['v']}"

    def oracle_bytes(self, shape):
        b, l, d, v = shape["b"], shape["l"], shape["d"], shape["v"]
        return 4 * b * l * v * 8 + 2 * b * v * d * 8

    def inputs(self, xp, shape, dtype, *, check, seed=0):
        b, l, d, v = shape["b"], shape["l"], shape["d"], shape["v"]
        mask = np.random.default_rng(seed + 1).random((b, l)) > 0.25
        mask[:, 0] = True
        if b > 1:
            mask[-1] = False  # an all-masked row: out = 0, no gradient
        if check:
            # multiples of 1/4 in [-1, 1]: every logit is a multiple of 1/16 well inside the
            # range where float16/bfloat16 represent it exactly, so the arg-max is the
            # oracle's in every dtype (a near-tie rounded otherwise may legitimately move it)
            rng = np.random.default_rng(seed)

            def grid(*s):
                return xp.asarray((rng.integers(-4, 5, size=s) / 4).astype(dtype))

            return grid(b, l, d), grid(v, d), grid(v), xp.asarray(mask)
        # hidden states ~ N(0, 1), weight rows ~ N(0, 1/D): logits ~ N(0, 1); the bias -1
        # leaves a realistic fraction (~1/2 .. 1 after the max over L) of the outputs active
        rng = xp.random.default_rng(seed)
        x = rng.standard_normal((b, l, d), dtype=xp.float32)
        w = rng.standard_normal((v, d), dtype=xp.float32) * np.float32(1 / math.sqrt(d))
        bias = rng.standard_normal(v, dtype=xp.float32) * np.float32(0.5) - np.float32(1)
        return cast(xp, x, dtype), cast(xp, w, dtype), cast(xp, bias, dtype), xp.asarray(mask)

    def grad(self, xp, shape, dtype, *, check):
        rng = np.random.default_rng(12345)
        if not check:
            return cast(xp, xp.ones((shape["b"], shape["v"]), dtype=xp.float32), dtype)
        g = rng.integers(-4, 5, size=(shape["b"], shape["v"])) / 4
        return xp.asarray(g.astype(dtype))

    def run(self, inputs, shape, grad, *, check):
        x, w, bias, mask = inputs
        out, ctx = cupynce.splade_pool_forward(x, w, bias, mask, activation=shape["activation"])
        return out, list(cupynce.splade_pool_backward(ctx, grad))

    def oracle(self, inputs, shape, grad, *, check):
        x, w, bias, mask = inputs
        out, grads = R.splade_pool(x, w, bias, mask, shape["activation"], grad)
        return out, list(grads)

    def torch_step(self, torch, inputs, shape, grad, *, dtype=None, compile=False):
        fn = torch_reference(torch, "splade_pool")
        if shape["activation"] != "log1p_relu":
            raise ValueError(f"splade_pool: the PyTorch formula here is log1p_relu's, got "
                             f"activation={shape['activation']!r}")
        leaves = _leaves(torch, inputs[:3], dtype)
        mask = to_torch(torch, inputs[3])
        g = to_torch(torch, grad).to(leaves[0].dtype)
        return torch_step(torch, torch.compile(fn, dynamic=False) if compile else fn, leaves,
                          extra=(mask,), grad_output=g)


# ------------------------------------------------------------------------------------------
# the registry
# ------------------------------------------------------------------------------------------
REGISTRY: Dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to :data:`REGISTRY` (replacing an entry of the same name)."""
    REGISTRY[spec.name] = spec
    return spec


for _spec in (NTXent(), InfoNCE(), SupCon(), ClipLoss(), SigLip(), SpladePool()):
    register(_spec)


def available_ops() -> Dict[str, Optional[str]]:
    """``{name: None if runnable here else the reason}`` for every registered op."""
    return {name: spec.available() for name, spec in REGISTRY.items()}
