"""A vector laid out like the trained parameters, stored in int8 blocks: the predictor's direction.

One byte per value plus one fp32 scale per ``BLOCK`` (256) values, 8.125 bits per value: about a
quarter of fp32 and half of bf16. The codes and scales follow
:func:`hybrid_kernels.quantize_int8` with ``granularity="block"`` (symmetric absmax, round half
to even), so :func:`hybrid_kernels.apply_delta_` adds ``s · d`` to the weights reading the codes
and scales directly, dequantizing inside its one pass.

Layout: each parameter's segment is padded to whole blocks (at most ``BLOCK − 1`` pad values per
parameter, always code 0), so every block belongs to one parameter and the per-parameter code
and scale views are exactly what ``quantize_int8`` would give for that parameter alone.

The vector is read and written a *bucket* at a time (:func:`~hybrid_trainer.update_recovery.flat_buckets`,
the buckets the update recovery computes the update in): :meth:`Int8BlockVector.read` dequantizes
one bucket into an fp32 transient (``update_recovery.chunk_for`` values at most, plus the pads),
the caller averages in fp32, :meth:`Int8BlockVector.write` quantizes it back. No fp32 copy of the
whole vector exists.
Each write rounds every value of the bucket to the block's grid again: an EMA stored this way
loses the part of a step smaller than half a grid step (``absmax / 254`` of its block), which
``tests/test_predictor_int8.py`` bounds against the fp32 EMA.
"""
from __future__ import annotations

import torch

import hybrid_kernels as hk

from .update_recovery import CHUNK_ALIGN, bucket_pieces, flat_buckets

BLOCK = 256  # values per scale; divides CHUNK_ALIGN, so a bucket's pieces start on block boundaries
assert CHUNK_ALIGN % BLOCK == 0


def block_count(sizes: list[int]) -> int:
    """Scales an :class:`Int8BlockVector` over tensors of ``sizes`` values holds (each padded to whole blocks)."""
    return sum(-(-n // BLOCK) for n in sizes)


class Int8BlockVector:
    """Int8 codes and fp32 block scales of a vector shaped like ``params`` (initially zero).

    Attributes:
        code_views: per parameter, int8 ``[*p.shape]`` views of the codes.
        scale_views: per parameter, fp32 ``[ceil(p.numel() / BLOCK)]`` views of the scales.
        buckets: ``flat_buckets`` of the parameters' sizes (unpadded flat coordinates).
        piece_lengths, piece_params: per bucket, each piece's length and owning parameter index
            (a long tensor on the device), as :class:`~hybrid_trainer.update_recovery.AdamUpdateRecovery` has them.
    """

    block = BLOCK

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        self.device = device
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self._starts, offset = [], 0  # each parameter's first value in the padded layout
        for n in self.sizes:
            self._starts.append(offset)
            offset += -(-n // BLOCK) * BLOCK
        self.codes = torch.zeros(offset, dtype=torch.int8, device=device)
        self.scales = torch.zeros(offset // BLOCK, dtype=torch.float32, device=device)
        self.code_views = [self.codes[s:s + n].view(p.shape) for s, n, p in zip(self._starts, self.sizes, params)]
        self.scale_views = [self.scales[s // BLOCK:s // BLOCK + -(-n // BLOCK)] for s, n in zip(self._starts, self.sizes)]
        self.buckets = flat_buckets(self.sizes)
        self.piece_lengths, self.piece_params = bucket_pieces(self.buckets, device)
        # Per bucket: its padded range [first, last) and each piece's (offset, length) inside it.
        self._ranges: list[tuple[int, int]] = []
        self._piece_slices: list[list[tuple[int, int]]] = []
        for _, _, pieces in self.buckets:
            first = self._starts[pieces[0][0]] + pieces[0][1]
            index, _, stop = pieces[-1]
            # A piece ends its parameter (then the pads follow) or at a multiple of the chunk.
            last = self._starts[index] + (-(-stop // BLOCK) * BLOCK)
            self._ranges.append((first, last))
            self._piece_slices.append([(self._starts[i] + a - first, b - a) for i, a, b in pieces])

    def read(self, bucket: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Bucket ``bucket`` dequantized: (fp32 transient over its padded range, per-piece views of it)."""
        first, last = self._ranges[bucket]
        values = hk.dequantize_int8(self.codes[first:last], self.scales[first // BLOCK:last // BLOCK],
                                    "block", BLOCK, torch.float32)
        return values, [values[o:o + n] for o, n in self._piece_slices[bucket]]

    def write(self, bucket: int, values: torch.Tensor) -> None:
        """Quantize ``values`` (a :meth:`read` transient of bucket ``bucket``, pads left at 0) into the bucket."""
        first, last = self._ranges[bucket]
        codes, scales = hk.quantize_int8(values, "block", BLOCK)
        self.codes[first:last].copy_(codes)
        self.scales[first // BLOCK:last // BLOCK].copy_(scales)

    # -- whole-vector forms, for checkpoints and inspection (not used while training) -----------------
    def flat_codes(self) -> torch.Tensor:
        """The codes without pads, ``[numel]`` int8 (a copy)."""
        if not self.code_views:
            return self.codes.new_zeros(0)
        return torch.cat([v.reshape(-1) for v in self.code_views])

    def load_codes(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Restore :meth:`flat_codes` and :attr:`scales` as saved."""
        if codes.numel() != self.numel or scales.shape != self.scales.shape:
            raise ValueError(f"int8 direction: {codes.numel()} codes and {tuple(scales.shape)} scales do not fit "
                             f"{self.numel} values in {self.scales.numel()} blocks")
        for view, part in zip(self.code_views, codes.split(self.sizes)):
            view.view(-1).copy_(part)
        self.scales.copy_(scales)

    def dequantized(self) -> torch.Tensor:
        """The whole vector in fp32, ``[numel]`` without pads: a full copy, for inspection and
        checkpoint conversion only."""
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for bucket, (start, _, _) in enumerate(self.buckets):
            _, pieces = self.read(bucket)
            for piece in pieces:
                out[start:start + piece.numel()].copy_(piece)
                start += piece.numel()
        return out

    def quantize_from(self, flat: torch.Tensor) -> None:
        """Store ``flat`` (``[numel]``, any float dtype and device), a bucket at a time."""
        if flat.numel() != self.numel:
            raise ValueError(f"int8 direction: {flat.numel()} values do not fit {self.numel}")
        for bucket, (start, stop, _) in enumerate(self.buckets):
            first, last = self._ranges[bucket]
            values = torch.zeros(last - first, dtype=torch.float32, device=self.device)
            pieces = [values[o:o + n] for o, n in self._piece_slices[bucket]]
            source = flat[start:stop].to(self.device, torch.float32)
            for piece, part in zip(pieces, source.split(self.piece_lengths[bucket])):
                piece.copy_(part)
            self.write(bucket, values)
