"""A module of the stand-in for torchvision (see torchvision._standin)."""

from torchvision._standin import placeholder
from torchvision.transforms import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
