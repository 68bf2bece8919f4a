"""The stand-in's torchvision.transforms (see torchvision._standin)."""

import enum

from torchvision._standin import placeholder


class InterpolationMode(enum.Enum):
    """torchvision's names for the interpolation modes."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
