"""The optimizer step in two halves (skiptrain/runtime/step.py): the sync (``exchange_stages``),
which a swarm node runs before the iteration's commit, and its application (``apply_step``);
and the rewind of a sync whose iteration is not applied (``Healer.rewind_sync``)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from skiptrain.config import DPConfig, TrainConfig
from skiptrain.dp import make_strategy
from skiptrain.optim import build_optimizer
from skiptrain.runtime.node.healing import Healer
from skiptrain.runtime.node.state import Attempt
from skiptrain.runtime.step import (Exchanged, HostedStage, apply_step, exchange_first, exchange_stages,
                                    optimizer_step)

STRATEGIES = ["allreduce", "powersgd", "demo", "diloco", "sparseloco"]
TC = TrainConfig(grad_clip=0.5)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 3))


def _grad(m, seed):
    torch.manual_seed(seed)
    m.zero_grad()
    m(torch.randn(8, 40)).pow(2).sum().backward()


def _replica(strategy):
    m = _model()
    dp = DPConfig(strategy=strategy, topk=4, values="sign2", indices="u12", sync_every=2, powersgd_rank=2)
    s = make_strategy(dp, m.named_parameters(), None, TC)
    return m, s, build_optimizer(m.named_parameters(), TC, s.update_rule)


def _params(m):
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_halves_apart_are_the_one_step_and_the_first_touches_no_parameter(strategy):
    """exchange_stages, anything in between, then apply_step: the parameters and the strategy's
    state of optimizer_step, bit for bit; between the halves the parameters and the optimizer
    are untouched."""
    ma, sa, oa = _replica(strategy)
    mb, sb, ob = _replica(strategy)
    for it in range(5):
        _grad(ma, it), _grad(mb, it)
        optimizer_step([HostedStage(0, sa, 2)], oa, 0.01, TC.grad_clip)
        before, opt_state = _params(mb), copy.deepcopy(ob.state_dict())
        ex = exchange_stages([HostedStage(0, sb, 2)], 0.01, TC.grad_clip)
        assert all(torch.equal(a, b) for a, b in zip(before, mb.parameters()))
        assert str(ob.state_dict()) == str(opt_state)
        apply_step(ex, ob, 0.01, TC.grad_clip)
        for a, b in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(a, b)
    assert str(sa.state_dict()) == str(sb.state_dict())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sync_rewound_to_its_state_and_run_again_is_the_sync_run_once(strategy):
    """What the rewind relies on: a strategy's state_dict holds everything its exchange changes.
    Sync, put the kept state back, sync again (the iteration run again): the same update and
    state as a twin that synced once."""
    ma, sa, oa = _replica(strategy)
    mb, sb, ob = _replica(strategy)
    for it in range(4):
        _grad(ma, it), _grad(mb, it)
        kept = sa.state_dict()
        exchange_stages([HostedStage(0, sa, 1)], 0.01, TC.grad_clip)       # a sync never applied
        sa.load_state_dict(kept)
        ea = exchange_stages([HostedStage(0, sa, 1)], 0.01, TC.grad_clip)
        eb = exchange_stages([HostedStage(0, sb, 1)], 0.01, TC.grad_clip)
        for (_, ua), (_, ub) in zip(ea.updates, eb.updates):
            assert (ua is None) == (ub is None)
            assert ua is None or all(torch.equal(ua[n], ub[n]) for n in ua)
        apply_step(ea, oa, 0.01, TC.grad_clip), apply_step(eb, ob, 0.01, TC.grad_clip)
        for a, b in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(a, b)


def test_only_a_strategy_that_clips_after_its_sync_exchanges_first():
    assert exchange_first([_replica(s)[1] for s in ("allreduce", "powersgd", "diloco", "sparseloco")])
    assert not exchange_first([_replica("demo")[1]])
    assert exchange_first([])


@pytest.mark.parametrize("committed, finished, stepped, rewound", [
    (False, True, False, True),      # committed nowhere: the iteration runs again, its sync with it
    (False, False, False, True),     # (this node's sync cut short)
    (True, False, False, True),      # committed, this node's sync cut short: redone over the survivors
    (True, True, False, False),      # committed, synced: the held sync is applied as it is
    (True, True, True, False),       # stepped already
])
def test_the_rewind_puts_back_the_state_only_where_the_sync_is_not_applied_as_it_is(committed, finished, stepped,
                                                                                    rewound):
    m, s, _ = _replica("powersgd")
    _grad(m, 0)
    kept = s.state_dict()
    a = Attempt(step_count=0, lr=0.01, stepped=stepped, sync_state={0: kept})
    ex = exchange_stages([HostedStage(0, s, 1)], 0.01, TC.grad_clip)
    a.exchanged = ex if finished else None
    healer = Healer(SimpleNamespace(control=None))
    healer.any_committed = committed
    st = SimpleNamespace(strats={0: s})
    healer.rewind_sync(st, a)
    assert (str(s.state_dict()) == str(kept)) == rewound
    assert (a.sync_state is None) == rewound
    healer.rewind_sync(st, a)          # a later recovery of the same attempt does not rewind again
    assert (str(s.state_dict()) == str(kept)) == rewound


def test_a_re_formed_strategy_finishes_the_step_its_predecessor_exchanged():
    """A peer died between the exchange and the step: the re-formed strategy (the state by name,
    then carry_step) applies the held sync as the old one would have, the phase's last outer sync
    of DiLoCo included (due at end_step, off its interval)."""
    ma, sa, oa = _replica("diloco")
    mb, sb, ob = _replica("diloco")
    for m in (ma, mb):
        _grad(m, 3)
    sa.end_step = sb.end_step = 1
    whole = optimizer_step([HostedStage(0, sa, 1)], oa, 0.01, TC.grad_clip)
    ex = exchange_stages([HostedStage(0, sb, 1)], 0.01, TC.grad_clip)
    _, new, _ = _replica("diloco")
    new.named, new.params = sb.named, sb.params          # (the same parameters, a new group)
    new.load_state_dict(sb.state_dict())
    new.carry_step(sb)
    h = HostedStage(0, new, 1)
    out = apply_step(Exchanged(**{**ex.__dict__, "hosted": [h], "updates": [(h, ex.updates[0][1])]}), ob, 0.01,
                     TC.grad_clip)
    assert out.stats[0].synced and whole.stats[0].synced and out.stats[0].step == whole.stats[0].step == 1
    for a, b in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(a, b)
