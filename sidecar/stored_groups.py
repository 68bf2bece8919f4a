"""What a start reads back of the store: :func:`stored_groups`.

A round decided REUSE writes only its short record, not its group's row, so
the rows alone may lag the answers ranks received; applying the records to
the rows they follow gives every such answer again after a crash.
"""

from __future__ import annotations

from moe_sidecar.core import policy
from moe_sidecar.core.group import GroupState
from moe_sidecar.store.sqlite import StateStore

__all__ = ["stored_groups"]


def stored_groups(store: StateStore) -> dict[str, GroupState]:
    """Every stored group, with the REUSE rounds recorded since its row was
    written applied to it (a record that does not follow its row, of a
    lifetime or round the row has since passed, changes nothing).

    Raises:
        StoreError: the store cannot be read.
    """
    groups = store.load()
    for record in store.reuse_records():
        state = groups.get(record.group)
        if state is None:
            continue
        replayed = policy.replay_reuse(state, record.lifetime_index, record.round, record.layer)
        if replayed is not None:
            groups[record.group] = replayed
    return groups
