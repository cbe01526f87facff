"""gru_cell benchmarks: the ensemble-batched op vs a per-member loop of torch.nn.GRUCell.

On CPU the op runs its eager path (batched baddbmm + fused-as-torch-allows pointwise ops and the
hand-written backward); on CUDA it runs the Triton kernels, and the loop runs cuDNN's fused cell.
The impl label records the backend that actually served the call.

FLOPs: the two projections, 2 * E * B * 3H * (I + H) forward; three times that forward+backward
(pointwise work is negligible next to them).

    OMP_NUM_THREADS=1 python -m pytest bench/test_bench_gru_cell.py --benchmark-min-rounds=20
"""
import pytest
import torch

import hybrid_kernels
from hybrid_kernels import gru_cell

from .conftest import sync, timed

IN_FEATURES, HIDDEN = 64, 256


def _setup(members, batch, device):
    torch.manual_seed(0)
    cells = [torch.nn.GRUCell(IN_FEATURES, HIDDEN, device=device) for _ in range(members)]
    x = torch.randn(members, batch, IN_FEATURES, device=device, requires_grad=True)
    h = torch.randn(members, batch, HIDDEN, device=device, requires_grad=True)
    stacked = [torch.stack([getattr(c, name).detach() for c in cells]).requires_grad_()
               for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    grad_out = torch.randn(members, batch, HIDDEN, device=device)
    return cells, x, h, stacked, grad_out


def _ensemble_step(x, h, stacked, grad_out, backward):
    args = (x, h, *stacked)

    def step():
        if backward:
            out = gru_cell(*args)
            grads = torch.autograd.grad(out, args, grad_out)
        else:
            with torch.no_grad():
                grads = gru_cell(*args)
        sync()
        return grads

    step()
    impl = f"gru_cell {hybrid_kernels.last_backend('gru_cell')}"
    return step, impl


def _loop_step(cells, x, h, grad_out, backward):
    params = [p for c in cells for p in c.parameters()]

    def step():
        if backward:
            out = torch.stack([cell(x[e], h[e]) for e, cell in enumerate(cells)])
            grads = torch.autograd.grad(out, [x, h, *params], grad_out)
        else:
            with torch.no_grad():
                grads = torch.stack([cell(x[e], h[e]) for e, cell in enumerate(cells)])
        sync()
        return grads

    return step, "nn.GRUCell loop"


@pytest.mark.parametrize("impl", ["ensemble", "loop"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("batch", [1, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("members", [3, 8], ids=lambda e: f"E{e}")
def test_gru_cell(benchmark, device, members, batch, backward, impl):
    cells, x, h, stacked, grad_out = _setup(members, batch, device)
    if impl == "ensemble":
        step, label = _ensemble_step(x, h, stacked, grad_out, backward)
    else:
        step, label = _loop_step(cells, x, h, grad_out, backward)
    shape = f"E={members} B={batch} I={IN_FEATURES} H={HIDDEN}"
    flops = 2 * members * batch * 3 * HIDDEN * (IN_FEATURES + HIDDEN) * (3 if backward else 1)
    benchmark.group = f"gru_cell {'fwd+bwd' if backward else 'fwd'} fp32 {shape}"
    benchmark.extra_info.update(impl=label, shape=shape, flops=flops, baseline=impl == "loop")
    timed(benchmark, step)
