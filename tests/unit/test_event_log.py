"""The run's membership events, as run.json lists them, from the coordinator's log."""

import json

from skiptrain.runtime.event_log import LOG_NAME, log_event, membership_events


def test_each_logged_event_is_listed_by_time_with_its_kind_node_generation_and_cause(tmp_path):
    log = tmp_path / LOG_NAME
    log_event(log, {"gen": 2, "node": 3, "cause": "stopped responding", "t_detect": 20.0})
    log_event(log, {"gen": 1, "node": 5, "cause": "died (killed by SIGKILL)", "t_detect": 10.0})
    log_event(log, {"gen": 3, "node": 7, "cause": "joined: stage 1", "join": True, "t_detect": 30.0})
    log_event(log, {"gen": None, "node": 8, "cause": "wrong or missing join secret", "refused": True,
                    "join": True, "t_detect": 31.0})
    log_event(log, {"gen": 4, "node": 9, "cause": "join cancelled: a failure", "join": True, "t_detect": 32.0})
    log_event(log, {"gen": 4, "node": None, "cause": "coordinator restarted", "restart": True, "t_detect": 33.0})
    with open(log, "a") as f:
        f.write("not json\n" + json.dumps([1, 2]) + "\n")
    events = membership_events(tmp_path)
    assert [(e["time"], e["kind"], e["node"], e["gen"]) for e in events] == [
        (10.0, "failed", 5, 1), (20.0, "failed", 3, 2), (30.0, "joined", 7, 3), (31.0, "refused", 8, None),
        (32.0, "join_cancelled", 9, 4), (33.0, "restart", None, 4)]
    assert events[0]["cause"] == "died (killed by SIGKILL)"


def test_a_run_without_events_lists_none(tmp_path):
    assert membership_events(tmp_path) == []
