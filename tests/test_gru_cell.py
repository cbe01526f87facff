"""gru_cell: Triton (interpreted on CPU) vs the eager reference, the eager reference vs
torch.nn.GRUCell, gradcheck of the hand-written eager backward, and argument checks."""
import importlib

import pytest
import torch

import hybrid_kernels
from hybrid_kernels import gru_cell
from hybrid_kernels.gru_cell import _gates_backward_eager, _gates_backward_triton

ARG_NAMES = ("x", "h", "w_ih", "w_hh", "b_ih", "b_hh")
# (E, B, I, H): the project's size, plus odd sizes that leave partial tiles.
SHAPES = [(3, 1, 64, 256), (3, 16, 64, 256), (3, 16, 5, 17), (2, 16, 5, 100)]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def make_inputs(members, batch, in_features, hidden, dtype=torch.float32, device="cpu", bias=True,
                requires_grad=True):
    """Random inputs at nn.GRUCell's init scale (uniform in +-1/sqrt(H)), so gates are not saturated."""
    bound = hidden ** -0.5

    def uniform(*shape):
        return (torch.rand(*shape, dtype=torch.float64) * 2 - 1) * bound

    tensors = [torch.randn(members, batch, in_features, dtype=torch.float64),
               torch.randn(members, batch, hidden, dtype=torch.float64),
               uniform(members, 3 * hidden, in_features),
               uniform(members, 3 * hidden, hidden),
               uniform(members, 3 * hidden) if bias else None,
               uniform(members, 3 * hidden) if bias else None]
    return [None if t is None else t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
            for t in tensors]


def forward_backward(args, grad_out=None):
    """h_new and the gradients of every tensor argument that requires grad (None elsewhere)."""
    out = gru_cell(*args)
    if grad_out is None:
        grad_out = torch.randn_like(out)
    wrt = [t for t in args if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wrt, grad_out))
    return out.detach(), [next(grads) if t is not None and t.requires_grad else None for t in args]


def assert_grads_close(actual, expected, **tol):
    for name, a, e in zip(ARG_NAMES, actual, expected):
        assert (a is None) == (e is None), name
        if a is not None:
            torch.testing.assert_close(a, e, **tol, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_KERNELS_BACKEND", raising=False)


def _run_backend(monkeypatch, backend, args, grad_out):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    out, grads = forward_backward(args, grad_out)
    assert hybrid_kernels.last_backend("gru_cell") == backend
    assert hybrid_kernels.last_backend("gru_cell_backward") == backend
    with torch.no_grad():  # inference path: no workspace written
        inference_out = gru_cell(*args)
    assert hybrid_kernels.last_backend("gru_cell") == backend
    torch.testing.assert_close(inference_out, out, rtol=0, atol=0)
    return out, grads


# --------------------------------------------------------------------------------------------
# Triton (interpreted) vs eager reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-B{}-I{}-H{}".format(*s))
def test_triton_matches_eager(monkeypatch, device, shape, dtype):
    args = make_inputs(*shape, dtype=dtype, device=device)
    grad_out = torch.randn(shape[0], shape[1], shape[3], dtype=dtype, device=device)
    out_t, grads_t = _run_backend(monkeypatch, "triton", args, grad_out)
    out_e, grads_e = _run_backend(monkeypatch, "eager", args, grad_out)
    assert out_t.dtype == dtype and out_t.shape == (shape[0], shape[1], shape[3])
    torch.testing.assert_close(out_t, out_e, **TOLERANCE[dtype])
    assert_grads_close(grads_t, grads_e, **TOLERANCE[dtype])
    if dtype == torch.float16:  # both paths could round too early in the same way: check against fp32
        with torch.no_grad():
            out_fp32 = gru_cell(*[None if t is None else t.float() for t in args])
        torch.testing.assert_close(out_t.float(), out_fp32, rtol=2e-3, atol=2e-3)


def test_triton_matches_eager_without_biases_and_frozen_weights(monkeypatch, device):
    x, h, w_ih, w_hh, _, _ = make_inputs(3, 16, 5, 17, device=device, bias=False)
    args = [x, h, w_ih.detach(), w_hh.detach(), None, None]
    grad_out = torch.randn(3, 16, 17, device=device)
    out_t, grads_t = _run_backend(monkeypatch, "triton", args, grad_out)
    out_e, grads_e = _run_backend(monkeypatch, "eager", args, grad_out)
    torch.testing.assert_close(out_t, out_e, **TOLERANCE[torch.float32])
    assert grads_t[2:] == [None] * 4
    assert_grads_close(grads_t, grads_e, **TOLERANCE[torch.float32])


def test_triton_reads_non_contiguous_inputs(monkeypatch, device):
    members, batch, in_features, hidden = 3, 16, 5, 17
    args = make_inputs(members, batch, in_features, hidden, device=device, requires_grad=False)
    # Same values, other layouts: h and x stored batch-major, w_hh column-major.
    args[0] = args[0].transpose(0, 1).contiguous().transpose(0, 1)
    args[1] = args[1].transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    args[3] = args[3].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not (args[0].is_contiguous() or args[1].is_contiguous() or args[3].is_contiguous())
    grad_out = torch.randn(batch, members, hidden, device=device).transpose(0, 1)
    out_t, grads_t = _run_backend(monkeypatch, "triton", args, grad_out)
    out_e, grads_e = _run_backend(monkeypatch, "eager", args, grad_out)
    torch.testing.assert_close(out_t, out_e, **TOLERANCE[torch.float32])
    assert_grads_close(grads_t, grads_e, **TOLERANCE[torch.float32])


def test_pointwise_backward_kernel_matches_eager_on_arbitrary_workspace(triton_backend, device):
    """Workspace values not tied together by a forward pass (r, z, n, gh_n independent), so a
    swapped or mis-offset workspace column cannot hide behind a coincidence."""
    members, batch, hidden = 2, 16, 100
    grad = torch.randn(members, batch, hidden, device=device)
    h = torch.randn(members, batch, hidden, device=device)
    ws = torch.cat([torch.rand(members, batch, 2 * hidden), torch.rand(members, batch, hidden) * 2 - 1,
                    torch.randn(members, batch, hidden)], dim=-1).to(device)
    for got, want in zip(_gates_backward_triton(grad, h, ws), _gates_backward_eager(grad, h, ws)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_triton_tiles_hidden_units_wider_than_one_block(monkeypatch, device):
    """H above the kernels' column block: several column tiles per row plus a partial last one
    (40 = 16 + 16 + 8). The interpreter's block (16384) is never exceeded by the other tests, so
    without a smaller block a dropped column offset or a single column tile would pass."""
    kernels = importlib.import_module("hybrid_kernels.gru_cell")
    monkeypatch.setattr(kernels, "_MAX_BLOCK_H", 16)
    members, batch, in_features, hidden = 2, 3, 5, 40
    assert kernels._tile_shape(members * batch, hidden) == (8, 16)  # 3 column tiles, the last partial
    args = make_inputs(members, batch, in_features, hidden, device=device)
    grad_out = torch.randn(members, batch, hidden, device=device)
    out_t, grads_t = _run_backend(monkeypatch, "triton", args, grad_out)
    out_e, grads_e = _run_backend(monkeypatch, "eager", args, grad_out)
    torch.testing.assert_close(out_t, out_e, **TOLERANCE[torch.float32])
    assert_grads_close(grads_t, grads_e, **TOLERANCE[torch.float32])


def test_empty_batch(triton_backend, device):
    args = make_inputs(3, 0, 5, 17, device=device)
    out, grads = forward_backward(args)
    assert out.shape == (3, 0, 17)
    assert hybrid_kernels.last_backend("gru_cell") == "triton"
    assert grads[2].shape == (3, 51, 5) and torch.count_nonzero(grads[2]) == 0


# --------------------------------------------------------------------------------------------
# Semantics: torch.nn.GRUCell
# --------------------------------------------------------------------------------------------
def _grucell_reference(cell, x, h, grad_out):
    x = x.detach().requires_grad_()
    h = h.detach().requires_grad_()
    out = cell(x, h)
    grads = torch.autograd.grad(out, [x, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh],
                                grad_out)
    return out.detach(), grads


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("shape", [(1, 16, 64, 256), (1, 1, 5, 17)], ids=["B16-I64-H256", "B1-I5-H17"])
def test_single_member_matches_nn_grucell(monkeypatch, device, backend, shape):
    _, batch, in_features, hidden = shape
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", backend)
    cell = torch.nn.GRUCell(in_features, hidden).to(device)
    x = torch.randn(batch, in_features, device=device)
    h = torch.randn(batch, hidden, device=device)
    grad_out = torch.randn(batch, hidden, device=device)
    expected_out, expected_grads = _grucell_reference(cell, x, h, grad_out)

    args = [t.detach()[None].clone().requires_grad_()
            for t in (x, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)]
    out, grads = forward_backward(args, grad_out[None])
    assert hybrid_kernels.last_backend("gru_cell") == backend
    torch.testing.assert_close(out[0], expected_out, rtol=1e-5, atol=1e-5)
    assert_grads_close([g[0] for g in grads], expected_grads, rtol=1e-5, atol=1e-5)


def test_members_are_independent_grucells(eager_backend, device):
    members, batch, in_features, hidden = 3, 4, 5, 17
    cells = [torch.nn.GRUCell(in_features, hidden).to(device) for _ in range(members)]
    x = torch.randn(members, batch, in_features, device=device)
    h = torch.randn(members, batch, hidden, device=device)
    stacked = [torch.stack([getattr(c, name).detach() for c in cells])
               for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    out = gru_cell(x, h, *stacked)
    with torch.no_grad():
        expected = torch.stack([cells[e](x[e], h[e]) for e in range(members)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# float64: the eager path and its hand-written backward
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_gradcheck_eager_backward(triton_backend, device, bias):
    args = make_inputs(2, 3, 4, 5, dtype=torch.float64, device=device, bias=bias)
    assert torch.autograd.gradcheck(gru_cell, tuple(args), eps=1e-6, atol=1e-8, rtol=1e-6)
    # float64 runs eager even when the dispatcher would pick Triton (the kernels compute in fp32).
    assert hybrid_kernels.last_backend("gru_cell") == "eager"
    assert hybrid_kernels.last_backend("gru_cell_backward") == "eager"


def test_float64_with_triton_demanded_raises(monkeypatch, device):
    monkeypatch.setenv("HYBRID_KERNELS_BACKEND", "triton")
    args = make_inputs(1, 2, 3, 4, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="float64"):
        gru_cell(*args)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
def _valid(**replace):
    args = dict(zip(ARG_NAMES, make_inputs(3, 4, 5, 6, requires_grad=False)))
    args.update(replace)
    return args


@pytest.mark.parametrize("name, bad, error, pattern", [
    ("x", torch.randn(4, 5), ValueError, r"x must have 3 dims \(E, B, I\)"),
    ("h", torch.randn(4, 6), ValueError, r"h must have 3 dims"),
    ("h", torch.randn(3, 4, 0), ValueError, r"h has shape \(3, 4, 0\): the hidden size H"),
    ("h", torch.randn(3, 5, 6), ValueError, r"h has shape \(3, 5, 6\) but expected \(E, B, H\) = \(3, 4, 6\)"),
    ("w_ih", torch.randn(3, 18, 4), ValueError, r"w_ih has shape \(3, 18, 4\) but expected \(E, 3H, I\) = \(3, 18, 5\)"),
    ("w_hh", torch.randn(3, 6, 6), ValueError, r"w_hh has shape \(3, 6, 6\) but expected \(E, 3H, H\) = \(3, 18, 6\)"),
    ("b_ih", torch.randn(18), ValueError, r"b_ih has shape \(18,\) but expected \(E, 3H\) = \(3, 18\)"),
    ("b_hh", torch.randn(2, 18), ValueError, r"b_hh has shape \(2, 18\) but expected \(E, 3H\)"),
    ("w_hh", torch.randn(3, 18, 6, dtype=torch.float16), TypeError, r"w_hh has dtype torch.float16 but x has torch.float32"),
    ("x", torch.randn(3, 4, 5, dtype=torch.bfloat16), TypeError, r"x has dtype torch.bfloat16"),
    ("x", torch.ones(3, 4, 5, dtype=torch.int32), TypeError, r"x has dtype torch.int32"),
    ("b_ih", [0.0] * 18, TypeError, r"b_ih must be a torch.Tensor, got list"),
    ("w_ih", torch.randn(3, 18, 5, device="meta"), ValueError, r"w_ih is on meta but x is on cpu"),
])
def test_invalid_arguments_raise_naming_the_argument(name, bad, error, pattern):
    with pytest.raises(error, match=pattern):
        gru_cell(**_valid(**{name: bad}))


# --------------------------------------------------------------------------------------------
# torch.compile (the library ops, their fake kernels and register_autograd)
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_library_ops_pass_opcheck(device):
    from hybrid_kernels.gru_cell import _gates_backward_op, _gru_cell_op

    args = make_inputs(3, 4, 5, 17, device=device)
    torch.library.opcheck(_gru_cell_op, (*args, True))
    detached = [t.detach() for t in args]
    torch.library.opcheck(_gru_cell_op, (*detached[:4], None, None, False))
    workspace = _gru_cell_op(*detached, True)[1]
    torch.library.opcheck(_gates_backward_op, (torch.randn(3, 4, 17, device=device), detached[1], workspace))


@pytest.mark.slow
def test_compiled_matches_eager(device):
    """Graph capture through the library op (fullgraph: no break at gru_cell) and its autograd.
    backend="aot_eager" checks the capture in ~1 s; inductor adds ~30 s of C++ compile here."""
    args = make_inputs(3, 4, 5, 17, device=device)
    grad_out = torch.randn(3, 4, 17, device=device)

    def two_steps(x, h, w_ih, w_hh, b_ih, b_hh):
        h1 = gru_cell(x, h, w_ih, w_hh, b_ih, b_hh)
        return gru_cell(x, h1 * 0.5, w_ih, w_hh, b_ih, b_hh)

    def run(fn):
        out = fn(*args)
        return out.detach(), torch.autograd.grad(out, args, grad_out)

    expected_out, expected_grads = run(two_steps)
    out, grads = run(torch.compile(two_steps, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, expected_grads, rtol=1e-5, atol=1e-5)
