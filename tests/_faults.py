"""What the reliability and fault-injection tests share: small models, the state a trainer keeps in
tensors, and the checks of the guard's invariant (everything finite; a faulty step leaves a state the run
had already reached)."""
import hashlib

import torch

from hybrid_trainer import HybridConfig, HybridTrainer

from _configs import FAST
from _digits import cross_entropy


def batch_norm_mlp(seed: int = 0, n_in: int = 64, hidden: int = 64, n_out: int = 10):
    """An MLP with a batch norm: its train-mode forwards change its running statistics."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, n_out))


def make_trainer(model_fn=batch_norm_mlp, seed=0, lr=3e-3, opt="adamw", loss_fn=cross_entropy, **overrides):
    model = model_fn(seed)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr) if opt == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    return HybridTrainer(model, optimizer, loss_fn, config=HybridConfig(**{**FAST, **overrides}))


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def non_finite(trainer) -> list[str]:
    """Names of the weights, buffers and optimizer-state tensors holding a NaN or an Inf."""
    bad = [f"weight {n}" for n, p in trainer.model.named_parameters() if not torch.isfinite(p).all()]
    bad += [f"buffer {n}" for n, b in trainer.model.named_buffers()
            if b.is_floating_point() and not torch.isfinite(b).all()]
    bad += [f"optimizer state {i}" for i, t in enumerate(optimizer_tensors(trainer.optimizer))
            if t.is_floating_point() and not torch.isfinite(t).all()]
    return bad


def fingerprint(trainer) -> str:
    """Digest of the weights and buffers (bit for bit)."""
    digest = hashlib.sha1()
    for t in list(trainer.model.parameters()) + list(trainer.model.buffers()):
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cloned(state):
    """A deep copy of a state dict whose tensors are copies (``state_dict()`` returns live tensors)."""
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cloned(v) for v in state]
    if isinstance(state, tuple):
        return tuple(cloned(v) for v in state)
    return state.detach().clone() if isinstance(state, torch.Tensor) else state
