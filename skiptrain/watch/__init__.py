"""skiptrain.watch: watching a run from its run directory alone (it never talks to a node).

* :mod:`.state` -- the run's state (nodes, loss, events, membership, ideas, Gantt) as one dict;
* :mod:`.ideas` -- what each idea did so far; :mod:`.simulated` -- the planned iteration, simulated;
* :mod:`.status` -- ``skiptrain status``: the state as one terminal screen or JSON;
* :mod:`.server` -- ``skiptrain dashboard``: a read-only web page (``static/``) polling the state;
* :mod:`.tensorboard_log` -- ``log.tensorboard=true``: TensorBoard event files of the run.

What the swarm writes for it: ``swarm.json`` (:mod:`skiptrain.runtime.swarm_view`) and each
node's ``live_node<r>.json`` (:mod:`skiptrain.runtime.live`); see docs/dashboard.md.
"""
