"""What a node accepts of an etcd document (moe_sidecar.etcd.document), the
backoff every etcd loop waits through, and the cluster store's flags."""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from moe_sidecar.config import ConfigError, SidecarConfig, add_serve_arguments, config_from_flags
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.limits import MAX_GENERATION
from moe_sidecar.core.plan import Capacities, Plan
from moe_sidecar.etcd.backoff import Backoff
from moe_sidecar.etcd.document import (
    MAC_PREFIX,
    DocumentRefused,
    DocumentRules,
    open_document,
    read_key_file,
    seal_document,
)
from moe_sidecar.etcd.replica import ReplicaSettings, replica_settings
from moe_sidecar.store.row_codec import encode_cluster_plan

pytestmark = pytest.mark.timeout(30)

KEY = b"/p/groups/g%2Fep2"
DOC = ClusterPlan("g/ep2", 2, 0, Plan(Capacities(256, 4096, 14336, 8, 256), 0, 3), 3)
SIGNED = DocumentRules(key=b"k" * 32)


def refused(rules: DocumentRules, value: bytes, local: ClusterPlan | None = None) -> str:
    with pytest.raises(DocumentRefused) as raised:
        open_document(rules, KEY, value, DOC.name, local)
    return raised.value.reason


def test_a_bare_document_opens_without_a_key_and_is_refused_with_one() -> None:
    bare = seal_document(DocumentRules(), KEY, DOC)
    assert bare == encode_cluster_plan(DOC)
    assert open_document(DocumentRules(), KEY, bare, DOC.name, None) == DOC
    assert refused(SIGNED, bare) == "unauthenticated"


def test_a_signed_document_opens_only_with_its_key_under_its_etcd_key() -> None:
    signed = seal_document(SIGNED, KEY, DOC)
    assert signed.startswith(MAC_PREFIX)
    assert open_document(SIGNED, KEY, signed, DOC.name, None) == DOC
    assert refused(DocumentRules(key=b"x" * 32), signed) == "bad_mac"
    # Replayed under another group's key: the MAC binds the key.
    with pytest.raises(DocumentRefused, match="HMAC"):
        open_document(SIGNED, b"/p/groups/other", signed, DOC.name, None)
    tampered = signed.replace(b'"generation":3', b'"generation":4')
    assert tampered != signed and refused(SIGNED, tampered) == "bad_mac"
    # A node without the key reads it unchecked (the key is rolled out node by node).
    assert open_document(DocumentRules(), KEY, signed, DOC.name, None) == DOC


def test_size_decoding_and_name_are_checked() -> None:
    body = encode_cluster_plan(DOC)
    assert refused(DocumentRules(max_document_bytes=len(body) - 1), body) == "too_big"
    assert refused(DocumentRules(), b"{not json") == "unreadable"
    other = encode_cluster_plan(replace(DOC, name="other/ep2"))
    assert refused(DocumentRules(), other) == "wrong_key"


def test_a_generation_or_epoch_far_past_the_groups_is_implausible() -> None:
    rules = DocumentRules(max_generation_lead=10, max_epoch_lead=2)
    far = replace(DOC, generation=MAX_GENERATION)
    assert refused(rules, encode_cluster_plan(far)) == "implausible"
    ahead = replace(DOC, generation=13)
    assert refused(rules, encode_cluster_plan(ahead)) == "implausible"
    # Measured from the group here: ten past this node's 3 is plausible.
    assert open_document(rules, KEY, encode_cluster_plan(ahead), DOC.name, DOC) == ahead
    epoch = replace(DOC, epoch=3, plan=replace(DOC.plan, epoch=3) if DOC.plan else None)
    assert refused(rules, encode_cluster_plan(epoch)) == "implausible"


def test_the_key_file_needs_sixteen_bytes(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match=r"holds 5 bytes; a key needs at least 16"):
        read_key_file(path)
    path.write_bytes(b"0123456789abcdef0123\n")
    assert read_key_file(path) == b"0123456789abcdef0123"
    with pytest.raises(ValueError, match="cannot read it"):
        read_key_file(tmp_path / "missing")


def test_the_store_flags_reach_the_replica(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"k" * 20)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--store-page-bytes", str(8 << 20), "--store-max-document-bytes", str(1 << 19)]
    )
    environ = {"MOE_SIDECAR_STORE_KEY_FILE": str(key), "MOE_SIDECAR_MAX_MERGED_GROUPS": "0"}
    config = config_from_flags(args, environ)
    assert config.max_merged_groups == 0
    settings = replica_settings(config)
    assert settings.rules.key == b"k" * 20
    assert settings.page_keys == 16  # 8 MiB of 512 KiB documents
    assert ReplicaSettings().page_keys == 32  # the defaults: 32 MiB of 1 MiB documents


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("store_page_bytes", 1 << 30, "store_page_bytes=1073741824"),
        ("store_max_document_bytes", 64 << 20, "at most store_page_bytes"),
        ("store_max_generation_lead", 0, "store_max_generation_lead=0"),
        ("store_max_epoch_lead", True, "store_max_epoch_lead=True"),
        ("max_merged_groups", -1, "max_merged_groups=-1"),
        ("store_key_file", Path("/nonexistent/key"), "no such file"),
    ],
)
def test_bad_store_limits_are_refused_naming_the_field(
    field: str, value: object, names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        SidecarConfig(**{field: value})  # type: ignore[arg-type]


async def test_backoff_doubles_to_its_ceiling_and_a_stop_cuts_it_short() -> None:
    backoff = Backoff(0.05, 0.3)
    assert [backoff.next_delay() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.next_delay() == 0.05
    stop = asyncio.Event()
    stop.set()
    started = time.monotonic()
    await Backoff(30.0, 30.0).pause(stop)
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="ceiling"):
        Backoff(1.0, 0.5)
