"""Parameter shapes of real models, so multi-tensor benchmarks see realistic size mixes."""
from __future__ import annotations

import math


def gpt_param_shapes(d_model: int, n_layers: int, vocab: int, context: int = 1024) -> list[tuple[int, ...]]:
    """Shapes of a GPT-2-style decoder's parameters (tied embeddings, biases, layer norms)."""
    shapes: list[tuple[int, ...]] = [(vocab, d_model), (context, d_model)]
    for _ in range(n_layers):
        shapes += [(d_model,), (d_model,),                      # ln_1
                   (3 * d_model, d_model), (3 * d_model,),      # qkv
                   (d_model, d_model), (d_model,),              # attention out
                   (d_model,), (d_model,),                      # ln_2
                   (4 * d_model, d_model), (4 * d_model,),      # mlp up
                   (d_model, 4 * d_model), (d_model,)]          # mlp down
    shapes += [(d_model,), (d_model,)]                          # ln_f
    return shapes


# ~10M and ~100M parameters: 12-layer decoders at widths 256 and 768.
MODELS = {
    "10M": gpt_param_shapes(d_model=256, n_layers=12, vocab=8192, context=256),
    "100M": gpt_param_shapes(d_model=768, n_layers=12, vocab=16384, context=1024),
}


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)
