"""Ensemble-batched GRU cell: ``gru_cell(x, h, w_ih, w_hh, b_ih, b_hh) -> h_new``.

Semantics: exactly ``torch.nn.GRUCell`` (the cuDNN "linear before reset" form), applied to E
independent ensemble members at once. For member e, with ``W_i* = w_ih[e]`` and ``W_h* = w_hh[e]``
split into row blocks in PyTorch's gate order (r, z, n)::

    r  = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr)
    z  = sigmoid(x W_iz^T + b_iz + h W_hz^T + b_hz)
    n  = tanh(x W_in^T + b_in + r * (h W_hn^T + b_hn))
    h' = (1 - z) * n + z * h

So for E = 1 it equals ``nn.GRUCell`` with ``weight_ih = w_ih[0]``, ``weight_hh = w_hh[0]``,
``bias_ih = b_ih[0]``, ``bias_hh = b_hh[0]``. DreamerV3's variant (reset applied to the whole
candidate, update bias -1, norm on the pre-activations) is *not* offered here.

How the work is split (both backends):

* The two projections are torch matmuls (``baddbmm``, cuBLAS on a GPU), biases folded in:
  ``gi = x W_ih^T + b_ih`` and ``gh = h W_hh^T + b_hh``, each ``[E, B, 3H]``.
* Forward pointwise part, one fused Triton kernel (or the eager formula): reads gi, gh, h, writes
  h' and, when a backward will follow, a *workspace* ``[E, B, 4H]`` = ``[r | z | n | gh_n]``
  (``gh_n = h W_hn^T + b_hn``, the hidden-side candidate pre-activation), in the compute dtype.
* Backward pointwise part, one fused Triton kernel (or the eager formula): from dh', h and the
  workspace it writes the gradients of the gate pre-activations, ``d_gi`` and ``d_gh``
  (``[E, B, 3H]``; they differ only in the n block, where ``d_gh_n = d_gi_n * r``), and the
  direct part of dh (``dh' * z``).
* Then torch matmuls and sums: ``dx = d_gi W_ih``, ``dh = dh' z + d_gh W_hh``,
  ``dW_ih = d_gi^T x``, ``dW_hh = d_gh^T h``, ``db_ih = sum_B d_gi``, ``db_hh = sum_B d_gh``.
  Fusing the matmuls too would only pay for a persistent multi-step kernel, not for one step.

Dtypes: float32 and float16 on every backend (pointwise math in fp32, outputs and gradients in
the input dtype, workspace fp32). float64 always runs the eager reference (it exists for
``torch.autograd.gradcheck``; the kernels compute in fp32), and ``HYBRID_KERNELS_BACKEND=triton``
with float64 raises. bfloat16 is rejected: the Triton interpreter cannot check bf16 numerics.

The eager reference is an explicit formula both ways (hand-written backward, no autograd
inside), so gradcheck in float64 validates the backward the kernels are compared against.
Double backward is not supported (``once_differentiable``).

torch.compile: ``hybrid_kernels::gru_cell`` and ``hybrid_kernels::gru_cell_gates_backward`` are
torch.library ops with fake kernels; autograd is attached with ``register_autograd`` and the
backward matmuls stay plain torch ops that the compiler can see. In eager mode the public
function skips the dispatcher and calls the implementation through an autograd.Function.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ._dispatch import choose_backend, record, requested_backend
from ._triton_compat import INTERPRET, tl, triton

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.float64)

# Elements per program of the pointwise kernels. Under the interpreter the cost is per op, not
# per element, so one or two programs should cover a test-sized problem.
_TILE = 16384 if INTERPRET else 2048
_MAX_BLOCK_H = 16384 if INTERPRET else 256


# --------------------------------------------------------------------------------------------
# Triton kernels. Rows are the E*B (member, batch) pairs; columns the H hidden units. gi and gh
# rows hold [r | z | n] pre-activations (3H), workspace rows hold [r | z | n | gh_n] (4H).
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    # No libdevice under the interpreter. exp of a non-positive argument cannot overflow, and
    # the odd symmetry keeps full relative precision for negative x (error ~6e-8 in fp32).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _gru_forward_kernel(gi_ptr, gh_ptr, h_ptr, h_new_ptr, ws_ptr, n_rows, hidden,
                        SAVE_WORKSPACE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = rows64 * (3 * hidden) + cols[None, :]
    state = rows64 * hidden + cols[None, :]

    pre_r = (tl.load(gi_ptr + gate, mask=mask, other=0.0).to(tl.float32)
             + tl.load(gh_ptr + gate, mask=mask, other=0.0).to(tl.float32))
    pre_z = (tl.load(gi_ptr + gate + hidden, mask=mask, other=0.0).to(tl.float32)
             + tl.load(gh_ptr + gate + hidden, mask=mask, other=0.0).to(tl.float32))
    gi_n = tl.load(gi_ptr + gate + 2 * hidden, mask=mask, other=0.0).to(tl.float32)
    gh_n = tl.load(gh_ptr + gate + 2 * hidden, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + state, mask=mask, other=0.0).to(tl.float32)

    r = tl.sigmoid(pre_r)
    z = tl.sigmoid(pre_z)
    n = _tanh(gi_n + r * gh_n)
    h_new = n + z * (h - n)  # = (1 - z) * n + z * h
    tl.store(h_new_ptr + state, h_new.to(h_new_ptr.dtype.element_ty), mask=mask)

    if SAVE_WORKSPACE:
        ws = rows64 * (4 * hidden) + cols[None, :]
        tl.store(ws_ptr + ws, r, mask=mask)
        tl.store(ws_ptr + ws + hidden, z, mask=mask)
        tl.store(ws_ptr + ws + 2 * hidden, n, mask=mask)
        tl.store(ws_ptr + ws + 3 * hidden, gh_n, mask=mask)


@triton.jit
def _gru_backward_kernel(grad_ptr, h_ptr, ws_ptr, d_gi_ptr, d_gh_ptr, dh_direct_ptr,
                         n_rows, hidden, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate = rows64 * (3 * hidden) + cols[None, :]
    state = rows64 * hidden + cols[None, :]
    ws = rows64 * (4 * hidden) + cols[None, :]

    g = tl.load(grad_ptr + state, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + state, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(ws_ptr + ws, mask=mask, other=0.0)
    z = tl.load(ws_ptr + ws + hidden, mask=mask, other=0.0)
    n = tl.load(ws_ptr + ws + 2 * hidden, mask=mask, other=0.0)
    gh_n = tl.load(ws_ptr + ws + 3 * hidden, mask=mask, other=0.0)

    dh_direct = g * z
    d_pre_n = (g - dh_direct) * (1.0 - n * n)  # dh' (1 - z) tanh'
    d_pre_z = dh_direct * (h - n) * (1.0 - z)  # dh' (h - n) sigmoid'(z)
    d_pre_r = d_pre_n * gh_n * r * (1.0 - r)  # through n's pre-activation r * gh_n

    out_ty = d_gi_ptr.dtype.element_ty
    tl.store(d_gi_ptr + gate, d_pre_r.to(out_ty), mask=mask)
    tl.store(d_gi_ptr + gate + hidden, d_pre_z.to(out_ty), mask=mask)
    tl.store(d_gi_ptr + gate + 2 * hidden, d_pre_n.to(out_ty), mask=mask)
    tl.store(d_gh_ptr + gate, d_pre_r.to(out_ty), mask=mask)
    tl.store(d_gh_ptr + gate + hidden, d_pre_z.to(out_ty), mask=mask)
    tl.store(d_gh_ptr + gate + 2 * hidden, (d_pre_n * r).to(out_ty), mask=mask)
    tl.store(dh_direct_ptr + state, dh_direct.to(out_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers (gi, gh: [E, B, 3H] contiguous, as baddbmm returns them)
# --------------------------------------------------------------------------------------------
def _tile_shape(n_rows: int, hidden: int) -> tuple[int, int]:
    block_h = min(triton.next_power_of_2(hidden), _MAX_BLOCK_H)
    block_rows = max(1, min(triton.next_power_of_2(n_rows), _TILE // block_h))
    return block_rows, block_h


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gates_forward_triton(gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
                          save_workspace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = h.shape[-1]
    h = h.contiguous()
    h_new = torch.empty_like(h)
    ws_shape = (*h.shape[:-1], 4 * hidden) if save_workspace else (0,)
    ws = torch.empty(ws_shape, dtype=torch.float32, device=h.device)
    n_rows = h.numel() // max(hidden, 1)
    if h.numel():
        block_rows, block_h = _tile_shape(n_rows, hidden)
        grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(hidden, block_h))
        # Without a workspace the kernel never touches ws_ptr; h_new is passed only to fill the argument.
        _gru_forward_kernel[grid](gi, gh, h, h_new, ws if save_workspace else h_new, n_rows, hidden,
                                  SAVE_WORKSPACE=save_workspace, BLOCK_ROWS=block_rows,
                                  BLOCK_H=block_h)
    return h_new, ws


def _gates_backward_triton(grad_h_new: torch.Tensor, h: torch.Tensor, ws: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = h.shape[-1]
    grad_h_new = grad_h_new.contiguous()
    h = h.contiguous()
    gate_shape = (*h.shape[:-1], 3 * hidden)
    d_gi = torch.empty(gate_shape, dtype=h.dtype, device=h.device)
    d_gh = torch.empty(gate_shape, dtype=h.dtype, device=h.device)
    dh_direct = torch.empty_like(h)
    n_rows = h.numel() // max(hidden, 1)
    if h.numel():
        block_rows, block_h = _tile_shape(n_rows, hidden)
        grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(hidden, block_h))
        _gru_backward_kernel[grid](grad_h_new, h, ws, d_gi, d_gh, dh_direct, n_rows, hidden,
                                   BLOCK_ROWS=block_rows, BLOCK_H=block_h)
    return d_gi, d_gh, dh_direct


# --------------------------------------------------------------------------------------------
# Eager reference of the pointwise parts (the CPU production path and the test oracle).
# Same workspace layout and dtypes as the kernels, so either backward accepts either forward.
# Written with in-place / out= ops into the workspace: on CPU every extra temporary is another
# pass over memory and another ~3 us of per-op overhead.
# --------------------------------------------------------------------------------------------
def _gates_forward_eager(gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
                         save_workspace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = h.shape[-1]
    compute = _compute_dtype(h.dtype)
    # fp16 pre-activations are summed in fp32, as the kernel does (not rounded to fp16 first).
    gi, gh, h_c = gi.to(compute), gh.to(compute), h.to(compute)
    ws = torch.empty((*h.shape[:-1], 4 * hidden), dtype=compute, device=h.device)
    r_z, n, gh_n = ws[..., :2 * hidden], ws[..., 2 * hidden:3 * hidden], ws[..., 3 * hidden:]
    torch.add(gi[..., :2 * hidden], gh[..., :2 * hidden], out=r_z).sigmoid_()
    gh_n.copy_(gh[..., 2 * hidden:])
    # tanh(a) = 2 sigmoid(2a) - 1: torch's CPU tanh ran ~3x slower than its sigmoid on the dev
    # box (AVX2 build, 49K elements), and the identity costs only ~1e-7 absolute in fp32.
    torch.addcmul(gi[..., 2 * hidden:], ws[..., :hidden], gh_n, out=n).mul_(2.0).sigmoid_()
    n.mul_(2.0).sub_(1.0)
    h_new = torch.lerp(n, h_c, ws[..., hidden:2 * hidden])  # n + z (h - n)
    if not save_workspace:
        ws = ws.new_empty((0,))
    return h_new.to(h.dtype), ws


def _gates_backward_eager(grad_h_new: torch.Tensor, h: torch.Tensor, ws: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = h.shape[-1]
    compute = ws.dtype
    g, h_c = grad_h_new.to(compute), h.to(compute)
    r, z, n, gh_n = ws.split(hidden, dim=-1)
    d_gi = torch.empty((*h.shape[:-1], 3 * hidden), dtype=compute, device=h.device)
    d_pre_r, d_pre_z, d_pre_n = d_gi.split(hidden, dim=-1)
    dh_direct = g * z
    torch.mul(g - dh_direct, 1.0 - n * n, out=d_pre_n)  # dh' (1 - z) (1 - n^2)
    torch.mul(dh_direct * (h_c - n), 1.0 - z, out=d_pre_z)  # dh' (h - n) z (1 - z)
    torch.mul(d_pre_n * gh_n, r - r * r, out=d_pre_r)  # d_pre_n gh_n r (1 - r)
    d_gh = torch.empty_like(d_gi)
    d_gh[..., :2 * hidden].copy_(d_gi[..., :2 * hidden])
    torch.mul(d_pre_n, r, out=d_gh[..., 2 * hidden:])
    return d_gi.to(h.dtype), d_gh.to(h.dtype), dh_direct.to(h.dtype)


# --------------------------------------------------------------------------------------------
# Projections (torch matmuls, shared by both backends) and dispatch
# --------------------------------------------------------------------------------------------
def _project(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``inp @ weight^T + bias`` per member: [E, B, K] x [E, 3H, K] (+ [E, 3H]) -> [E, B, 3H]."""
    if bias is None:
        return torch.bmm(inp, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), inp, weight.transpose(1, 2))


def _backend(op: str, device: torch.device, dtype: torch.dtype) -> str:
    backend = choose_backend(op, device)
    if backend == "triton" and dtype == torch.float64:
        if requested_backend() == "triton":
            raise RuntimeError(f"{op}: HYBRID_KERNELS_BACKEND=triton but float64 inputs only run "
                               "the eager reference (the kernels compute in float32)")
        backend = "eager"
    record(op, backend)
    return backend


def _forward_impl(x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                  b_ih: Optional[torch.Tensor], b_hh: Optional[torch.Tensor],
                  save_workspace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    backend = _backend("gru_cell", x.device, x.dtype)
    gi = _project(x, w_ih, b_ih)
    gh = _project(h, w_hh, b_hh)
    if backend == "triton":
        return _gates_forward_triton(gi, gh, h, save_workspace)
    return _gates_forward_eager(gi, gh, h, save_workspace)


def _gates_backward_impl(grad_h_new: torch.Tensor, h: torch.Tensor, ws: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = _backend("gru_cell_backward", h.device, h.dtype)
    if backend == "triton":
        return _gates_backward_triton(grad_h_new, h, ws)
    return _gates_backward_eager(grad_h_new, h, ws)


def _backward_through_projections(d_gi: torch.Tensor, d_gh: torch.Tensor, dh_direct: torch.Tensor,
                                  x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor,
                                  w_hh: torch.Tensor, needs_grad: tuple[bool, ...]) -> tuple:
    """Gradients of (x, h, w_ih, w_hh, b_ih, b_hh) from those of the gate pre-activations."""
    dx = torch.bmm(d_gi, w_ih) if needs_grad[0] else None
    dh = torch.baddbmm(dh_direct, d_gh, w_hh) if needs_grad[1] else None
    dw_ih = torch.bmm(d_gi.transpose(1, 2), x) if needs_grad[2] else None
    dw_hh = torch.bmm(d_gh.transpose(1, 2), h) if needs_grad[3] else None
    db_ih = d_gi.sum(dim=1) if needs_grad[4] else None
    db_hh = d_gh.sum(dim=1) if needs_grad[5] else None
    return dx, dh, dw_ih, dw_hh, db_ih, db_hh


class _GRUCellFunction(torch.autograd.Function):
    """Eager-mode autograd: forward saves the workspace, backward runs the fused pointwise part."""

    @staticmethod
    def forward(ctx, x, h, w_ih, w_hh, b_ih, b_hh):
        h_new, ws = _forward_impl(x, h, w_ih, w_hh, b_ih, b_hh, save_workspace=True)
        ctx.save_for_backward(x, h, w_ih, w_hh, ws)
        return h_new

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h_new):
        x, h, w_ih, w_hh, ws = ctx.saved_tensors
        d_gi, d_gh, dh_direct = _gates_backward_impl(grad_h_new, h, ws)
        return _backward_through_projections(d_gi, d_gh, dh_direct, x, h, w_ih, w_hh,
                                             ctx.needs_input_grad)


# --------------------------------------------------------------------------------------------
# torch.library ops (graph capture under torch.compile)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("hybrid_kernels::gru_cell", mutates_args=())
def _gru_cell_op(x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                 b_ih: Optional[torch.Tensor], b_hh: Optional[torch.Tensor],
                 save_workspace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x, h, w_ih, w_hh, b_ih, b_hh, save_workspace)


@_gru_cell_op.register_fake
def _(x, h, w_ih, w_hh, b_ih, b_hh, save_workspace):
    ws_shape = (*h.shape[:-1], 4 * h.shape[-1]) if save_workspace else (0,)
    return torch.empty_like(h), h.new_empty(ws_shape, dtype=_compute_dtype(h.dtype))


@torch.library.custom_op("hybrid_kernels::gru_cell_gates_backward", mutates_args=())
def _gates_backward_op(grad_h_new: torch.Tensor, h: torch.Tensor, ws: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gates_backward_impl(grad_h_new, h, ws)


@_gates_backward_op.register_fake
def _(grad_h_new, h, ws):
    gate_shape = (*h.shape[:-1], 3 * h.shape[-1])
    return h.new_empty(gate_shape), h.new_empty(gate_shape), torch.empty_like(h)


def _op_setup_context(ctx, inputs, output):
    x, h, w_ih, w_hh, _b_ih, _b_hh, _save_workspace = inputs
    ctx.save_for_backward(x, h, w_ih, w_hh, output[1])


def _op_backward(ctx, grad_h_new, _grad_ws):
    x, h, w_ih, w_hh, ws = ctx.saved_tensors
    d_gi, d_gh, dh_direct = _gates_backward_op(grad_h_new.contiguous(), h, ws)
    grads = _backward_through_projections(d_gi, d_gh, dh_direct, x, h, w_ih, w_hh,
                                          ctx.needs_input_grad)
    return (*grads, None)


_gru_cell_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate(x, h, w_ih, w_hh, b_ih, b_hh) -> None:
    named = {"x": x, "h": h, "w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}
    for name, t in named.items():
        if t is None and name in ("b_ih", "b_hh"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: float32, float16 (and float64, eager only)")
    for name, t in named.items():
        if t is None or name == "x":
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; all inputs must share one dtype")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.dim() != 3:
        raise ValueError(f"x must have 3 dims (E, B, I), got shape {_shape(x)}")
    if h.dim() != 3:
        raise ValueError(f"h must have 3 dims (E, B, H), got shape {_shape(h)}")
    members, batch, in_features = x.shape
    hidden = h.shape[2]
    if hidden == 0:
        raise ValueError(f"h has shape {_shape(h)}: the hidden size H (last dim) must be at least 1")
    expected = {
        "h": ("(E, B, H)", (members, batch, hidden)),
        "w_ih": ("(E, 3H, I)", (members, 3 * hidden, in_features)),
        "w_hh": ("(E, 3H, H)", (members, 3 * hidden, hidden)),
        "b_ih": ("(E, 3H)", (members, 3 * hidden)),
        "b_hh": ("(E, 3H)", (members, 3 * hidden)),
    }
    for name, (symbolic, shape) in expected.items():
        t = named[name]
        if t is not None and _shape(t) != shape:
            raise ValueError(f"{name} has shape {_shape(t)} but expected {symbolic} = {shape} "
                             f"(E, B, I from x {_shape(x)}, H from h)")


def gru_cell(x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
             b_ih: Optional[torch.Tensor] = None, b_hh: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One GRU step for E ensemble members at once (``torch.nn.GRUCell`` semantics per member).

    Args:
        x: input, ``[E, B, I]``.
        h: previous hidden state, ``[E, B, H]``.
        w_ih: input weights, ``[E, 3H, I]``, row blocks in gate order (r, z, n) like
            ``GRUCell.weight_ih``.
        w_hh: hidden weights, ``[E, 3H, H]``, same order (``GRUCell.weight_hh``).
        b_ih, b_hh: biases ``[E, 3H]``, or None for zero.

    All tensors share one dtype (float32 or float16; float64 runs the eager reference only) and
    one device. Any layout is accepted (non-contiguous inputs are read through copies).

    Returns:
        ``h_new``, ``[E, B, H]``, in the input dtype:
        ``(1 - z) * n + z * h`` with ``r, z = sigmoid(gi_rz + gh_rz)``,
        ``n = tanh(gi_n + r * gh_n)``, ``gi = x w_ih^T + b_ih``, ``gh = h w_hh^T + b_hh``.
        Differentiable once with respect to every tensor argument.
    """
    _validate(x, h, w_ih, w_hh, b_ih, b_hh)
    tensors = [t for t in (x, h, w_ih, w_hh, b_ih, b_hh) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if torch.compiler.is_compiling():
        return _gru_cell_op(x, h, w_ih, w_hh, b_ih, b_hh, needs_grad)[0]
    # Direct calls: the torch.library dispatcher costs more than the work on CPU.
    if needs_grad:
        return _GRUCellFunction.apply(x, h, w_ih, w_hh, b_ih, b_hh)
    return _forward_impl(x, h, w_ih, w_hh, b_ih, b_hh, save_workspace=False)[0]
