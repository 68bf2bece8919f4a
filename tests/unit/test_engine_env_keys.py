"""The engines' rooms' own environment keys, as the sidecar reads them.

The daemon imports no client module, so ``moe_sidecar.config.flags`` spells
the keys the rooms read (``ENGINE_ENV_KEYS``); this test holds the two
spellings together and starts the sidecar's config reader on them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import pytest

from moe_sidecar.client import engines
from moe_sidecar.config import ConfigError, add_serve_arguments, config_from_flags
from moe_sidecar.config.flags import ENGINE_ENV_KEYS

pytestmark = pytest.mark.timeout(30)


def _rooms_keys() -> set[str]:
    keys: set[str] = set()
    for room in pkgutil.iter_modules(engines.__path__):
        settings = importlib.import_module(f"{engines.__name__}.{room.name}.settings")
        keys |= settings.ENV_KEYS
    return keys


def _config_from(env: dict[str, str]) -> object:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_flags(parser.parse_args([]), env)


def test_the_sidecar_knows_every_rooms_key_and_no_other() -> None:
    assert _rooms_keys() == ENGINE_ENV_KEYS
    assert "MOE_SIDECAR_VLLM" in ENGINE_ENV_KEYS


@pytest.mark.parametrize("key", sorted(ENGINE_ENV_KEYS))
def test_a_rooms_key_is_left_to_the_client(key: str) -> None:
    _config_from({key: "1"})


def test_a_misspelt_rooms_key_is_still_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="MOE_SIDECAR_VLMM"):
        _config_from({"MOE_SIDECAR_VLMM": "1"})
