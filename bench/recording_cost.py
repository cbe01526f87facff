"""What does recording one real update cost the predictor, per way of recording it?

    python -m bench.recording_cost [--models mlp-1ms fashion charlm mlp-4m] [--repeats 60]

The predictor records ``u = θ_after − θ_before`` of every real step while prediction can run,
either measured against a copy of the weights taken before the optimizer step or recomputed
after it from AdamW's state (:mod:`hybrid_trainer.update_recovery`: one fp32 copy of the model
less at the step's memory peak), and keeps its direction in fp32 or bf16. This times
``begin_step`` + ``end_step`` (the optimizer step between them is not counted) for the four
combinations on the parameters of ``bench.overhead``'s models (``mlp-4m``: one 2048×2048 layer,
where memory bandwidth rather than per-op cost sets the time), the arms interleaved in one
process, each figure the minimum over ``--repeats`` rounds. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import torch

from hybrid_trainer.predictor import DeltaPredictor

ARMS = {  # name: (recover from the optimizer's state, direction dtype)
    "copy, fp32": (False, torch.float32),
    "recovered, fp32": (True, torch.float32),
    "copy, bf16": (False, torch.bfloat16),
    "recovered, bf16": (True, torch.bfloat16),
    "recovered, int8": (True, torch.int8),
}


def model_params(name: str) -> list[torch.Tensor]:
    if name == "mlp-4m":
        torch.manual_seed(0)
        return [torch.randn(2048, 2048, requires_grad=True), torch.randn(2048, requires_grad=True)]
    from .overhead import make_workload

    return list(make_workload(name, 1, torch.device("cpu")).make_model(0).parameters())


def measure(name: str, repeats: int) -> dict[str, float]:
    """Minimum seconds of begin_step + end_step per arm; the optimizer step runs between them."""
    params = model_params(name)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    predictors = {arm: DeltaPredictor(params, direction_dtype=dtype) for arm, (_, dtype) in ARMS.items()}
    best = dict.fromkeys(ARMS, float("inf"))
    for _ in range(repeats):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        for arm, (recover, _) in ARMS.items():
            started = time.perf_counter()
            predictors[arm].begin_step(optimizer if recover else None)
            begun = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
            predictors[arm].end_step()
            best[arm] = min(best[arm], (begun - started) + (time.perf_counter() - stepped))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp-1ms", "fashion", "charlm", "mlp-4m"])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"begin_step + end_step, µs (minimum of {args.repeats} rounds; torch {torch.__version__})\n")
    print("| model | params | " + " | ".join(ARMS) + " |")
    print("|---|---|" + "---|" * len(ARMS))
    for name in args.models:
        best = measure(name, args.repeats)
        n = sum(p.numel() for p in model_params(name))
        print(f"| {name} | {n / 1e6:.2f}M | " + " | ".join(f"{1e6 * best[arm]:.0f}" for arm in ARMS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
