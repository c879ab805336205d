"""The iteration start's stop agreement (skiptrain/runtime/node/start.py): a stop carries its
reason, and every node ends for the reason agreed on, whether or not it read the request itself
(one node that saw the store's stop for want of a coordinator while its peers had not yet: they
all exit for it, so every supervisor waits for the next coordinator; the launcher's stop is a
finish).  Rank 0's view, over a stand-in control plane that hands it every node's flag."""

import torch

from skiptrain.runtime.membership import coordinator_key, sign
from skiptrain.runtime.node import STOP_KEY
from skiptrain.runtime.node.coordinator_link import CoordinatorLink
from skiptrain.runtime.node.start import IterationStart
from skiptrain.runtime.failure import NO_COORDINATOR

SECRET = "s3cret"


class _Store:
    def __init__(self, values: dict[str, str]):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key].encode()


class _Control:
    """Rank 0 of a control plane whose other nodes sent ``peer_flags``."""

    def __init__(self, link, peer_flags):
        self.link, self.peer_flags = link, peer_flags

    def gather_at_root(self, t):
        return torch.stack([t, *(torch.tensor([f], dtype=t.dtype) for f in self.peer_flags)])

    def sync(self, fn, *args):
        pass                    # (rank 0 filled the start itself; a broadcast leaves it as it is)


def _link(stop_value: str | None = None) -> CoordinatorLink:
    """A node's link to its coordinator as far as stops go: its store holds the signed stop, if any."""
    link = object.__new__(CoordinatorLink)
    values = {} if stop_value is None else {STOP_KEY: sign(coordinator_key(SECRET), STOP_KEY, stop_value)}
    link.__dict__.update(hb_store=_Store(values), coord_key=coordinator_key(SECRET), forged_stop=False,
                         stopped_for=None, watch=None, rank=0)
    return link


def _agree(link, peer_flags):
    stop, _, _ = IterationStart(_Control(link, peer_flags)).agree(wait=False)
    return stop


def test_a_node_that_did_not_read_the_stop_ends_for_the_reason_its_peer_read():
    link = _link()
    assert _agree(link, [0.0, 2.0, 0.0])            # node 2 saw the store's stop, this one not yet
    assert link.stopped_for == NO_COORDINATOR


def test_the_launchers_stop_is_agreed_as_the_launchers():
    link = _link()
    assert _agree(link, [1.0, 0.0])
    assert link.stopped_for == "1"


def test_the_stop_for_want_of_a_coordinator_wins_over_the_launchers():
    link = _link("1")
    assert link.stop_code() == 1.0
    assert _agree(link, [2.0])
    assert link.stopped_for == NO_COORDINATOR


def test_a_node_reads_its_own_signed_stop_and_nothing_else():
    assert _link(NO_COORDINATOR).stop_code() == 2.0
    link = _link()
    assert link.stop_code() == 0.0
    assert not _agree(link, [0.0, 0.0]) and link.stopped_for is None
    forged = _link()
    forged.hb_store.values[STOP_KEY] = sign(coordinator_key("not the secret"), STOP_KEY, NO_COORDINATOR)
    assert forged.stop_code() == 0.0
