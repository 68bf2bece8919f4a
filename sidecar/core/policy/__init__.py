"""The decision core: rounds, lifetimes, commits, resets, merges. Pure.

Frozen values in (:mod:`moe_sidecar.core.group`), a :class:`~moe_sidecar.core.effects.Step`
out: the new state, the reply for the caller and the effects to carry out.
No grpc, no asyncio, no torch, no clock: the time is an argument (``now``, in
seconds of whatever clock the caller uses consistently). The sidecar's state
holder and the client's embedded mode both drive groups through these
functions, and plans only move through :mod:`moe_sidecar.core.plan`'s lattice.

One module per event a group meets:

* :mod:`.propose` (with :mod:`.restart` and :mod:`.rounds`): a rank's
  proposal joins its round; the last local rank closes it with one decision
  or one refusal for everyone. The round and the group it belongs to are
  values with methods (:class:`~moe_sidecar.core.group.OpenRound`,
  :class:`~moe_sidecar.core.group.GroupState`: a proposal joins or leaves a
  round, the slots each proof holds, the plan a round decides, a rank's
  record replaced, a closed round kept); each step asks them and builds its
  step from their answers;
* :mod:`.commit`: a rank holds the decided plan (across nodes: a plan above
  it in the lattice, joined into the stored one);
* :mod:`.depart`: a rank's session ended (or came back on a new stream);
* :mod:`.deadlines`: a round or a restart timed out; a restarted (or
  paused) sidecar takes its groups up again;
* :mod:`.recovery`: a restarted sidecar applies the REUSE rounds recorded
  beside a row to it; a row of a release that recorded none may lag them,
  and a later proposal catches the group up;
* :mod:`.merge`: a plan decided on another node arrives through the cluster store;
* :mod:`.admin`: a reset forgets the stored plan; a group is checked removable;
* :mod:`.views`: membership views move (a departure, an admin exclusion).
* :mod:`.rejoin`: a replacement for a departed rank, carrying the running
  lifetime's proof, joins the next view at a new generation.

Every event a step publishes is made by :func:`.events.group_event`; every
field is checked by :mod:`.validation` first.
"""

from __future__ import annotations

from moe_sidecar.core.cluster import MAX_HISTORY
from moe_sidecar.core.group import RETAINED_ROUNDS
from moe_sidecar.core.policy.admin import check_removable, reset
from moe_sidecar.core.policy.commit import commit
from moe_sidecar.core.policy.deadlines import expire, paused, resume
from moe_sidecar.core.policy.depart import depart, reconnect
from moe_sidecar.core.policy.merge import merge
from moe_sidecar.core.policy.propose import propose
from moe_sidecar.core.policy.recovery import replay_reuse
from moe_sidecar.core.policy.validation import validate_group_name, validate_proposal
from moe_sidecar.core.policy.views import acknowledge_view, exclude

__all__ = [
    "MAX_HISTORY",
    "RETAINED_ROUNDS",
    "acknowledge_view",
    "check_removable",
    "commit",
    "depart",
    "exclude",
    "expire",
    "merge",
    "paused",
    "propose",
    "reconnect",
    "replay_reuse",
    "reset",
    "resume",
    "validate_group_name",
    "validate_proposal",
]
