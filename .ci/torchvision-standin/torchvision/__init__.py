"""A stand-in for torchvision in .ci/sglang-env.sh's environment (see _standin)."""

from torchvision._standin import placeholder

__version__ = "0.28.0"


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
