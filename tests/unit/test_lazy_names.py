"""The command packages' faces: every public name resolves to its module's
object, and names load their module only on first use."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from moe_sidecar.client.lazy_names import lazy_names

pytestmark = pytest.mark.timeout(60)

PACKAGES = ("moe_sidecar.client.prewarm", "moe_sidecar.client.simulate", "moe_sidecar.client.size")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_its_modules_object(package: str) -> None:
    face = importlib.import_module(package)
    for name in face.__all__:
        value = getattr(face, name)  # raises if the table misses the name
        if inspect.isclass(value) or inspect.isfunction(value):
            # Defined in one of the package's modules, and that object itself.
            assert value.__module__.startswith(f"{package}."), (name, value.__module__)
            assert getattr(importlib.import_module(value.__module__), name) is value, name
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        face.not_a_name  # noqa: B018


@pytest.mark.parametrize("package", PACKAGES)
def test_the_face_imports_none_of_its_modules(package: str) -> None:
    code = (
        f"import sys, {package} as p; "
        f"sys.exit(sorted(m for m in sys.modules if m.startswith('{package}.')) != [])"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_a_name_under_two_modules_is_refused() -> None:
    with pytest.raises(ValueError, match="'x' listed under both 'a' and 'b'"):
        lazy_names("pkg", {"a": ("x",), "b": ("x", "y")})


def test_a_name_loads_from_its_module() -> None:
    getattr_ = lazy_names("json", {"decoder": ("JSONDecoder",)})
    assert getattr_("JSONDecoder") is importlib.import_module("json.decoder").JSONDecoder
    with pytest.raises(AttributeError, match="module 'json' has no attribute 'dumps'"):
        getattr_("dumps")


def test_the_client_face_gives_its_light_names_without_torch() -> None:
    # The counters and errors are torch-free; only the manager needs torch.
    code = (
        "import sys, moe_sidecar.client as c; c.ManagerCounters, c.InternalError, c.sizing; "
        "assert c.ManagerCounters.__module__ == 'moe_sidecar.client.counters'; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("package", ["moe_sidecar.client", *PACKAGES])
def test_dir_lists_the_lazy_names_without_loading_torch(package: str) -> None:
    # In a fresh process: dir() shows every public name, and loads no torch for it.
    code = (
        f"import sys, {package} as p; "
        "missing = sorted(set(p.__all__) - set(dir(p))); "
        "sys.exit(f'{missing} not in dir()' if missing else 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
