"""A learned far-horizon nowcaster: from the last few snapshots of every parameter tensor, the
displacement of every weight at several horizons at once.

Input: ``context + 1`` snapshots taken ``spacing`` real steps apart (default 5 snapshots, 50 steps
apart), flat fp32, and the model's layout (:func:`describe_model`). Output: for every horizon
``k`` in ``horizons`` (in units of ``spacing``; default 1, 2, 4, 8, 16, 32, 40) the predicted
displacement ``W(t + k*spacing) - W(t)`` of every weight, one head per horizon; ``predict`` serves
any horizon in between by interpolating neighbouring heads.

Two models share the features and the heads:

* :class:`WeightNowcaster`: a per-weight MLP. Each weight sees its own normalised displacement
  history, its normalised value and its tensor's context (layer kind, depth, fan-in, how fast the
  tensor moves relative to its size).
* :class:`NeuronNowcaster`: message passing over the network's neuron graph, in the spirit of NiNo
  (Knyazev et al., ICLR 2025): neurons are nodes, weights are edges between the neuron they feed
  and the neuron they read from; a bias or a norm's gain is an edge from a virtual per-tensor
  node. Each round, every neuron averages the states of its incoming and outgoing edges over every
  tensor that touches it, and every edge is updated from its own state and its two neurons. All
  aggregations are means over neurons, so permuting the hidden neurons of a layer permutes the
  output the same way (no positional neuron encodings).

Neuron graph (:func:`describe_model`): a tensor's input neurons are the output neurons of the most
recent earlier tensor with that many outputs (parameters in registration order, which follows the
forward pass in ordinary ``nn.Sequential`` / block models); when there is none they are a fresh
group (the network's inputs, a flatten). An embedding's columns are the residual stream, and every
later linear layer writing that width writes back into it (the transformer's residual stream);
an attention output projection reads a fresh group (the attention values). Linear, convolution
(a kernel tap is one more edge between the same two neurons), embedding, attention and
normalisation layers are handled; any other parameter is read as ``[features..., width]`` on the
most recent group of its last dimension's size.

Normalisation: per tensor, ``s`` = the mean absolute displacement per snapshot interval over the
window. Every displacement feature and every output is in units of ``s``, so the same model serves
tensors that move by 1e-5 or by 1e-1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_SPACING = 50
DEFAULT_CONTEXT = 4  # displacements seen: 5 snapshots
DEFAULT_HORIZONS = (1, 2, 4, 8, 16, 32, 40)
SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "nowcaster_weights.pt"
KINDS = ("linear", "conv", "embedding", "norm", "bias", "attention", "other")
_TINY = 1e-12

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
if hasattr(nn, "RMSNorm"):
    _NORMS = _NORMS + (nn.RMSNorm,)


@dataclass
class TensorInfo:
    """One parameter tensor seen as edges ``[rows, cols, taps]`` between neuron groups.

    ``rows`` index ``out_group`` (the neurons the tensor writes), ``cols`` index ``in_group`` (the
    neurons it reads; -1: a single virtual node of this tensor, as for a bias), ``taps`` are extra
    edges between the same pair (a convolution's kernel positions). ``transposed``: the stored
    tensor is ``[cols, rows]`` (an embedding table).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    kind: str
    depth: float
    rows: int
    cols: int
    taps: int
    out_group: int
    in_group: int
    transposed: bool = False

    def to_edges(self, flat: torch.Tensor) -> torch.Tensor:
        """``[..., numel]`` -> ``[..., rows, cols, taps]``."""
        lead = flat.shape[:-1]
        if self.transposed:
            return flat.reshape(*lead, self.cols, self.rows, self.taps).transpose(-3, -2)
        return flat.reshape(*lead, self.rows, self.cols, self.taps)

    def storage_view(self, h: torch.Tensor) -> torch.Tensor:
        """``[numel, C]`` (storage order) -> a view ``[a, b, taps, C]``: ``a, b`` are ``rows, cols``,
        or ``cols, rows`` when ``transposed``. No copy."""
        a, b = (self.cols, self.rows) if self.transposed else (self.rows, self.cols)
        return h.view(a, b, self.taps, h.shape[-1])

    @property
    def row_axis(self) -> int:
        return 1 if self.transposed else 0

    def from_edges(self, edges: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_edges`: ``[..., rows, cols, taps]`` -> ``[..., numel]``."""
        if self.transposed:
            edges = edges.transpose(-3, -2)
        return edges.reshape(*edges.shape[:-3], self.numel)


@dataclass
class Layout:
    """Every trainable parameter of a model, in ``model.parameters()`` order, and its neuron groups."""

    tensors: list[TensorInfo]
    group_sizes: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)


def describe_model(model: nn.Module) -> Layout:
    """The neuron graph of ``model`` (see the module docstring for the rules)."""
    order = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    groups: list[int] = []
    latest: dict[int, int] = {}  # width -> most recent group of that many output neurons
    residual: dict[int, int] = {}  # width -> the residual stream opened by an embedding
    found: list[tuple[int, TensorInfo]] = []

    def new_group(size: int) -> int:
        groups.append(size)
        return len(groups) - 1

    def reads(size: int) -> int:
        return latest[size] if size in latest else new_group(size)

    def writes(size: int) -> int:
        g = residual[size] if size in residual else new_group(size)
        latest[size] = g
        return g

    # A container's own parameters (a GPT's position table) are read after its layers, so that
    # they land on the groups those layers opened.
    modules = list(model.named_modules())
    leaves_first = [m for m in modules if not any(True for _ in m[1].children())] + \
        [m for m in modules if any(True for _ in m[1].children())]
    seen: set[int] = set()
    for mod_name, module in leaves_first:
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) not in order or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            shape = tuple(p.shape)
            info = dict(name=name, shape=shape, numel=p.numel(), offset=0, depth=0.0, taps=1, transposed=False)
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and p_name == "weight":
                attention_out = "attention" in type(_parent(model, mod_name)).__name__.lower() and \
                    mod_name.endswith(("out_proj", "proj", "o_proj", "c_proj")) and \
                    not mod_name.endswith(("qkv", "q_proj", "k_proj", "v_proj"))
                in_g = new_group(shape[1]) if attention_out else reads(shape[1])
                out_g = writes(shape[0])
                kind = "conv" if p.dim() > 2 else ("attention" if _inside_attention(model, mod_name) else "linear")
                info.update(kind=kind, rows=shape[0], cols=shape[1], taps=int(math.prod(shape[2:])),
                            out_group=out_g, in_group=in_g)
            elif isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and p_name == "bias":
                info.update(kind="bias", rows=shape[0], cols=1, out_group=latest.get(shape[0], -1), in_group=-1)
                if info["out_group"] < 0:
                    info["out_group"] = new_group(shape[0])
            elif isinstance(module, nn.Embedding):
                in_g = new_group(shape[0])
                out_g = new_group(shape[1])
                residual[shape[1]] = out_g
                latest[shape[1]] = out_g
                info.update(kind="embedding", rows=shape[1], cols=shape[0], out_group=out_g, in_group=in_g,
                            transposed=True)
            elif isinstance(module, _NORMS) or p.dim() == 1:
                kind = "norm" if isinstance(module, _NORMS) else "other"
                info.update(kind=kind, rows=shape[0], cols=1, out_group=reads(shape[0]), in_group=-1)
            else:  # any other parameter: [features..., width] on the latest group of that width
                width = shape[-1]
                rest = int(math.prod(shape[:-1]))
                info.update(kind="other", rows=width, cols=rest, out_group=reads(width),
                            in_group=new_group(rest) if rest > 1 else -1, transposed=True)
            found.append((order[id(p)], TensorInfo(**info)))
    if len(found) != len(order):
        raise ValueError(f"model has {len(order)} trainable parameters but {len(found)} were described")
    found.sort(key=lambda x: x[0])
    tensors = [t for _, t in found]
    offset = 0
    weight_layers = [t for t in tensors if t.kind in ("linear", "conv", "embedding", "attention")]
    n_layers = max(1, len(weight_layers) - 1)
    layer_index = 0
    for t in tensors:
        t.offset = offset
        offset += t.numel
        if t.kind in ("linear", "conv", "embedding", "attention"):
            t.depth = layer_index / n_layers
            layer_index += 1
        else:
            t.depth = max(0, layer_index - 1) / n_layers
    return Layout(tensors, groups)


def _parent(model: nn.Module, name: str) -> nn.Module:
    if "." not in name:
        return model
    return model.get_submodule(name.rsplit(".", 1)[0])


def _inside_attention(model: nn.Module, name: str) -> bool:
    return "attention" in type(_parent(model, name)).__name__.lower()


# ---------------------------------------------------------------------------- features ----
N_FEATURES = DEFAULT_CONTEXT + 1 + 3 + len(KINDS) + 2


def tensor_stats(window: torch.Tensor, info: TensorInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, w_rms, const)`` of one tensor: its displacement unit ``s`` (mean absolute
    displacement per interval), its weights' RMS, and its tensor-level features."""
    deltas = window[1:] - window[:-1]  # [context, numel], oldest first
    s = deltas.abs().mean().clamp_min(_TINY)
    w_rms = window[-1].pow(2).mean().sqrt().clamp_min(_TINY)
    first, last = deltas[0].abs().mean().clamp_min(_TINY), deltas[-1].abs().mean().clamp_min(_TINY)
    tensor_level = torch.stack([
        torch.log10(s / w_rms).clamp(-8, 2) / 4,  # how fast the tensor moves relative to its size
        torch.log(last / first).clamp(-5, 5) / 2,  # speeding up or slowing down
        torch.log10(torch.tensor(float(max(1, info.cols * info.taps)))) / 3,  # fan-in
    ])
    kind = torch.zeros(len(KINDS))
    kind[KINDS.index(info.kind)] = 1.0
    const = torch.cat([tensor_level, kind, torch.tensor([info.depth, 1.0 if info.kind == "bias" else 0.0])])
    return s, w_rms, const


def element_features(window: torch.Tensor, s: torch.Tensor, w_rms: torch.Tensor, const: torch.Tensor) -> torch.Tensor:
    """``[n, N_FEATURES]`` features of a contiguous range of one tensor's elements
    (``window``: ``[context + 1, n]``), given :func:`tensor_stats`."""
    deltas = window[1:] - window[:-1]
    newest_first = (deltas.flip(0) / s).clamp(-50, 50)  # [context, n]
    per_elem = torch.cat([newest_first, (window[-1] / w_rms).clamp(-20, 20)[None]], dim=0).t()
    return torch.cat([per_elem, const.expand(window.shape[1], const.numel())], dim=1)


def tensor_features(window: torch.Tensor, info: TensorInfo, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element features of one tensor and its displacement unit.

    Args:
        window: ``[context + 1, numel]`` fp32 snapshots of this tensor, oldest first.
    Returns:
        ``([numel, N_FEATURES], s)`` (storage order) where ``s`` (a 0-dim tensor) is the mean absolute
        displacement per interval, the unit of every displacement feature and of the output.
    """
    s, w_rms, const = tensor_stats(window, info)
    return element_features(window, s, w_rms, const), s


# Inference runs in chunks of about this many weights, so the per-weight activations of the
# hidden layers stay in cache instead of streaming [P, width] tensors through memory (the
# difference is most of a call's time on a CPU). Training runs unchunked (autograd).
_CHUNK = 1 << 15


def _chunks(info: TensorInfo):
    """Ranges ``(lo, hi)`` of the storage's first axis, and elements per index of that axis."""
    first = info.cols if info.transposed else info.rows
    per = info.numel // first
    step = max(1, _CHUNK // per)
    return [(lo, min(first, lo + step)) for lo in range(0, first, step)], per


# ------------------------------------------------------------------------------ models ----
def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                         nn.Linear(hidden, n_out))


class Nowcaster(nn.Module):
    """Shared interface: ``forward(window, layout) -> [H, P]`` displacements, one row per horizon."""

    variant = "base"

    def __init__(self, context: int = DEFAULT_CONTEXT, horizons: tuple[int, ...] = DEFAULT_HORIZONS,
                 spacing: int = DEFAULT_SPACING):
        super().__init__()
        if context != DEFAULT_CONTEXT:
            raise ValueError(f"context must be {DEFAULT_CONTEXT} (the feature width), got {context}")
        if not horizons or any(k < 1 for k in horizons) or list(horizons) != sorted(set(horizons)):
            raise ValueError(f"horizons must be increasing positive ints, got {horizons}")
        self.context, self.horizons, self.spacing = context, tuple(int(k) for k in horizons), spacing

    def config(self) -> dict[str, Any]:
        return dict(context=self.context, horizons=list(self.horizons), spacing=self.spacing)

    def predict_flat(self, window: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Displacements ``[H, P]`` (absolute units) for flat snapshots ``window [context+1, P]``."""
        if window.dim() != 2 or window.shape[0] != self.context + 1 or window.shape[1] != layout.total:
            raise ValueError(f"window must be [{self.context + 1}, {layout.total}], got {list(window.shape)}")
        return self(window.float(), layout)

    @torch.no_grad()
    def predict(self, window: torch.Tensor, layout: Layout, horizon: float) -> torch.Tensor:
        """The displacement ``[P]`` ``horizon`` spacings ahead (any positive real): linear between
        the two neighbouring heads, proportional below the first, the last head beyond it."""
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        out = self.predict_flat(window, layout)
        hs = self.horizons
        if horizon <= hs[0]:
            return out[0] * (horizon / hs[0])
        if horizon >= hs[-1]:
            return out[-1]
        j = next(i for i in range(1, len(hs)) if hs[i] >= horizon)
        a = (horizon - hs[j - 1]) / (hs[j] - hs[j - 1])
        return out[j - 1] * (1 - a) + out[j] * a


class WeightNowcaster(Nowcaster):
    """Per-weight MLP over the shared features (no communication between weights)."""

    variant = "weight"

    def __init__(self, hidden: int = 48, **kw):
        super().__init__(**kw)
        self.hidden = hidden
        self.net = _mlp(N_FEATURES, hidden, len(self.horizons))

    def config(self) -> dict[str, Any]:
        return dict(super().config(), hidden=self.hidden)

    def forward(self, window: torch.Tensor, layout: Layout) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._forward_chunked(window, layout)
        outs = []
        for info in layout.tensors:
            feats, s = tensor_features(window[:, info.offset:info.offset + info.numel], info, self.context)
            outs.append(self.net(feats).t() * s)  # [H, numel]
        return torch.cat(outs, dim=1)

    def _forward_chunked(self, window: torch.Tensor, layout: Layout) -> torch.Tensor:
        out = window.new_empty(len(self.horizons), layout.total)
        for info in layout.tensors:
            w = window[:, info.offset:info.offset + info.numel]
            s, w_rms, const = tensor_stats(w, info)
            ranges, per = _chunks(info)
            for lo, hi in ranges:
                f = element_features(w[:, lo * per:hi * per], s, w_rms, const)
                out[:, info.offset + lo * per:info.offset + hi * per] = self.net(f).t() * s
        return out


class _Round(nn.Module):
    """One message-passing round: edges -> neurons (means) -> edges."""

    def __init__(self, width: int):
        super().__init__()
        self.to_out_node = nn.Linear(width, width)
        self.to_in_node = nn.Linear(width, width)
        self.node = nn.Sequential(nn.SiLU(), nn.Linear(width, width), nn.SiLU())
        self.edge_self = nn.Linear(width, width)
        self.edge_out = nn.Linear(width, width, bias=False)
        self.edge_in = nn.Linear(width, width, bias=False)
        self.edge_post = nn.Linear(width, width)

    def forward(self, hs: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
        """``hs[i]``: ``[numel_i, width]`` edge states of tensor i, storage order."""
        width = self.to_out_node.out_features
        sums = [hs[0].new_zeros(n, width) for n in layout.group_sizes]
        counts = [0] * len(layout.group_sizes)
        local_in = []
        for h, info in zip(hs, layout.tensors):
            v = info.storage_view(h)
            r = info.row_axis
            sums[info.out_group] = sums[info.out_group] + self.to_out_node(v.mean(dim=(1 - r, 2)))
            counts[info.out_group] += 1
            m_in = self.to_in_node(v.mean(dim=(r, 2)))  # [cols, width]
            if info.in_group >= 0:
                sums[info.in_group] = sums[info.in_group] + m_in
                counts[info.in_group] += 1
                local_in.append(None)
            else:
                local_in.append(m_in)
        nodes = [self.node(s / max(1, c)) for s, c in zip(sums, counts)]
        out = []
        for h, info, m_in in zip(hs, layout.tensors, local_in):
            n_out = self.edge_out(nodes[info.out_group])
            n_in = self.edge_in(nodes[info.in_group] if info.in_group >= 0 else self.node(m_in))
            a, b = (n_in, n_out) if info.transposed else (n_out, n_in)
            msg = info.storage_view(self.edge_self(h)) + a[:, None, None, :] + b[None, :, None, :]
            out.append(h + self.edge_post(torch.nn.functional.silu(msg)).view_as(h))
        return out

    def nodes(self, hs: list[torch.Tensor], layout: Layout) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Neuron states per group, and the virtual input node of each tensor without an input group."""
        width = self.to_out_node.out_features
        sums = [hs[0].new_zeros(n, width) for n in layout.group_sizes]
        counts = [0] * len(layout.group_sizes)
        local = []
        for h, info in zip(hs, layout.tensors):
            v = info.storage_view(h)
            r = info.row_axis
            sums[info.out_group] += self.to_out_node(v.mean(dim=(1 - r, 2)))
            counts[info.out_group] += 1
            m_in = self.to_in_node(v.mean(dim=(r, 2)))
            if info.in_group >= 0:
                sums[info.in_group] += m_in
                counts[info.in_group] += 1
                local.append(None)
            else:
                local.append(self.node(m_in))
        return [self.node(s / max(1, c)) for s, c in zip(sums, counts)], local

    def update_chunked_(self, hs: list[torch.Tensor], layout: Layout) -> None:
        """The round in place, chunk by chunk (inference only; same values as :meth:`forward`)."""
        nodes, local = self.nodes(hs, layout)
        for h, info, n_local in zip(hs, layout.tensors, local):
            n_out = self.edge_out(nodes[info.out_group])
            n_in = self.edge_in(nodes[info.in_group] if info.in_group >= 0 else n_local)
            a, b = (n_in, n_out) if info.transposed else (n_out, n_in)
            ranges, per = _chunks(info)
            v = info.storage_view(h)
            for lo, hi in ranges:
                hc = v[lo:hi]
                msg = self.edge_self(hc) + a[lo:hi, None, None, :] + b[None, :, None, :]
                hc += self.edge_post(torch.nn.functional.silu(msg))


class NeuronNowcaster(Nowcaster):
    """Message passing over the neuron graph (edges = weights), ``rounds`` rounds of width ``width``."""

    variant = "neuron"

    def __init__(self, width: int = 16, rounds: int = 2, **kw):
        super().__init__(**kw)
        self.width, self.rounds = width, rounds
        self.encode = nn.Sequential(nn.Linear(N_FEATURES, width), nn.SiLU(), nn.Linear(width, width))
        self.layers = nn.ModuleList(_Round(width) for _ in range(rounds))
        self.decode_h = nn.Linear(width, 2 * width)
        self.decode_f = nn.Linear(N_FEATURES, 2 * width, bias=False)  # a skip from the raw features
        self.decode = nn.Sequential(nn.SiLU(), nn.Linear(2 * width, len(self.horizons)))

    def config(self) -> dict[str, Any]:
        return dict(super().config(), width=self.width, rounds=self.rounds)

    def _forward_chunked(self, window: torch.Tensor, layout: Layout) -> torch.Tensor:
        stats, hs = [], []
        for info in layout.tensors:
            w = window[:, info.offset:info.offset + info.numel]
            st = tensor_stats(w, info)
            stats.append(st)
            h = window.new_empty(info.numel, self.width)
            ranges, per = _chunks(info)
            for lo, hi in ranges:
                h[lo * per:hi * per] = self.encode(element_features(w[:, lo * per:hi * per], *st))
            hs.append(h)
        for layer in self.layers:
            layer.update_chunked_(hs, layout)
        out = window.new_empty(len(self.horizons), layout.total)
        for info, h, st in zip(layout.tensors, hs, stats):
            w = window[:, info.offset:info.offset + info.numel]
            ranges, per = _chunks(info)
            for lo, hi in ranges:
                sl = slice(lo * per, hi * per)
                y = self.decode(self.decode_h(h[sl]) + self.decode_f(element_features(w[:, sl], *st)))
                out[:, info.offset + sl.start:info.offset + sl.stop] = y.t() * st[0]
        return out

    def forward(self, window: torch.Tensor, layout: Layout) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._forward_chunked(window, layout)
        feats, units = [], []
        for info in layout.tensors:
            f, s = tensor_features(window[:, info.offset:info.offset + info.numel], info, self.context)
            feats.append(f)
            units.append(s)
        hs = [self.encode(f) for f in feats]
        for layer in self.layers:
            hs = layer(hs, layout)
        outs = []
        for h, f, s, info in zip(hs, feats, units, layout.tensors):
            y = self.decode(self.decode_h(h) + self.decode_f(f))  # [numel, H]
            outs.append(y.t() * s)
        return torch.cat(outs, dim=1)


VARIANTS = {"weight": WeightNowcaster, "neuron": NeuronNowcaster}


def build_nowcaster(variant: str = "neuron", **config) -> Nowcaster:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant](**config)


def relative_error(pred: torch.Tensor, target: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Per horizon: mean over tensors of ``|pred - target|^2 / |target|^2`` (1.0 = predicting no
    movement). ``pred`` and ``target`` are ``[H, P]``."""
    errs = []
    for info in layout.tensors:
        sl = slice(info.offset, info.offset + info.numel)
        num = (pred[:, sl] - target[:, sl]).pow(2).sum(dim=1)
        den = target[:, sl].pow(2).sum(dim=1).clamp_min(_TINY)
        errs.append((num / den).clamp(max=100.0))
    return torch.stack(errs).mean(dim=0)


def save_nowcaster(model: Nowcaster, path: str | Path, meta: dict[str, Any] | None = None) -> None:
    torch.save(dict(variant=model.variant, config=model.config(),
                    state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
                    meta=meta or {}), Path(path))


def load_nowcaster(path: str | Path | None = None) -> Nowcaster:
    """The nowcaster saved at ``path`` (default: the one shipped with the package)."""
    path = Path(path) if path is not None else SHIPPED_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"no nowcaster weights at {path}")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    cfg = dict(blob["config"])
    cfg["horizons"] = tuple(cfg["horizons"])
    model = build_nowcaster(blob["variant"], **cfg)
    model.load_state_dict(blob["state_dict"])
    model.meta = blob.get("meta", {})
    return model.eval()
