"""What a test can check of a written plot: it decodes as an image of the size its figure was
given, and it is drawn on (a blank or failed figure has a handful of colours)."""
from pathlib import Path

import numpy as np
from matplotlib.image import imread


def assert_plot(path: Path, size_in: tuple[float, float], dpi: int, min_colours: int = 30) -> np.ndarray:
    """``path`` is a PNG of ``size_in`` (width, height) inches at ``dpi`` with at least
    ``min_colours`` distinct colours; returns the image (height × width × channels, floats)."""
    image = imread(path)
    assert image.shape[:2] == (round(size_in[1] * dpi), round(size_in[0] * dpi)), (path.name, image.shape)
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) >= min_colours, (path.name, len(colours))
    return image
