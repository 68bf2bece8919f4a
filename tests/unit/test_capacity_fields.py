"""The capacity table is the vector: the dataclass, the proto, both codecs,
the display and the range checks all follow it field by field."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from moe_sidecar.core import limits
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS, CapacityField, capacity_field
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.plan import Capacities, Plan
from moe_sidecar.store.row_codec import (
    decode_cluster_plan,
    decode_group,
    encode_cluster_plan,
    encode_group,
)
from moe_sidecar.wire import codec, display
from moe_workspace.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(10)

EP_SIZE = 4


def _distinct() -> Capacities:
    """Capacities whose every field holds its own in-range value, so a codec
    that drops or swaps one field cannot round-trip them."""
    values = {field.name: field.lowest(EP_SIZE) + 3 + i for i, field in enumerate(CAPACITY_FIELDS)}
    return Capacities(**values)


def test_the_table_names_every_field_of_the_dataclass_in_order() -> None:
    assert [f.name for f in CAPACITY_FIELDS] == [f.name for f in fields(Capacities)]


def test_the_proto_has_a_field_for_every_table_entry_and_no_other() -> None:
    assert set(pb.Capacities.DESCRIPTOR.fields_by_name) == {f.name for f in CAPACITY_FIELDS}


def test_the_grpc_codec_round_trips_every_field() -> None:
    c = _distinct()
    wire = codec.capacities_to_proto(c)
    for field in CAPACITY_FIELDS:
        assert getattr(wire, field.name) == getattr(c, field.name)
    assert codec.capacities_from_proto(pb.Capacities.FromString(wire.SerializeToString())) == c


def test_the_row_codecs_round_trip_every_field() -> None:
    c = _distinct()
    plan = Plan(c, epoch=0, generation=1)
    state = GroupState(name="g", ep_size=EP_SIZE, local_ranks=1, plan=plan, generation=1)
    row = encode_group(state)
    assert json.loads(row)["plan"]["capacities"] == {
        f.name: getattr(c, f.name) for f in CAPACITY_FIELDS
    }
    assert decode_group(row) == state
    doc = ClusterPlan(name="g", ep_size=EP_SIZE, plan=plan, generation=1)
    assert decode_cluster_plan(encode_cluster_plan(doc)) == doc


def test_a_stored_row_missing_a_required_field_names_it() -> None:
    state = GroupState(
        name="g", ep_size=EP_SIZE, local_ranks=1, plan=Plan(_distinct(), 0, 1), generation=1
    )
    for field in CAPACITY_FIELDS:
        document = json.loads(encode_group(state))
        del document["plan"]["capacities"][field.name]
        with pytest.raises(ValueError, match=field.name):
            decode_group(json.dumps(document))


def test_the_display_shows_every_field() -> None:
    c = _distinct()
    text = display.capacities_text(c)
    for field in CAPACITY_FIELDS:
        assert f"{field.label or field.name}={getattr(c, field.name)}{field.unit}" in text
    assert display.plan_as_json(Plan(c, 0, 1), EP_SIZE, "")["capacities"] == {
        f.name: getattr(c, f.name) for f in CAPACITY_FIELDS
    }
    hidden = [f for f in CAPACITY_FIELDS if not f.shown_when_zero]
    for field in hidden:
        assert f"{field.label or field.name}=" not in display.capacities_text(
            replace(c, **{field.name: 0})
        )


@pytest.mark.parametrize("field", CAPACITY_FIELDS, ids=lambda f: f.name)
def test_the_range_check_names_each_field_at_both_ends(field: CapacityField) -> None:
    row = capacity_field(field.name)
    assert row is field
    for bad in (row.lowest(EP_SIZE) - 1, row.high + 1):
        with pytest.raises(InvalidArgument) as caught:
            limits.check_capacities("layer", replace(_distinct(), **{row.name: bad}), EP_SIZE)
        assert caught.value.field == f"layer.{row.name}"
