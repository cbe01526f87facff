"""sklearn digits (real data, 1797 8x8 images) as a tiny classification task for trainer tests."""
import torch
from sklearn.datasets import load_digits


def digits_tensors(random_labels: bool = False, seed: int = 0):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    if random_labels:
        y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))]
    return x, y


def batches(x, y, batch_size: int, steps: int, seed: int = 0):
    """A fixed, reproducible stream of `steps` minibatches (reshuffled each epoch)."""
    gen = torch.Generator().manual_seed(seed)
    out, order, pos = [], torch.randperm(len(x), generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > len(x):
            order, pos = torch.randperm(len(x), generator=gen), 0
        idx = order[pos:pos + batch_size]
        out.append((x[idx], y[idx]))
        pos += batch_size
    return out


def mlp(seed: int = 0, hidden: int = 64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def cross_entropy(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
