"""What every module of the stand-in gives for a name it does not define.

SGLang's config and multimodal modules, and transformers' image utilities,
import torchvision names at import time; the tests never call them. A name
looked up here is a class whose use says that it is the stand-in.
"""

from __future__ import annotations

from typing import Any


def placeholder(module: str, name: str) -> type:
    """A class standing for ``module.name``; constructing or calling it raises."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(
            f"{module}.{name} is the CI stand-in for torchvision (.ci/sglang-env.sh)"
        )

    return type(name, (), {"__new__": refuse, "__call__": refuse, "__module__": module})
