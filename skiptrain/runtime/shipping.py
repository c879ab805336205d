"""A node's outputs sent to the coordinator's run directory over the wire (no shared file system).

While the run goes on, rank 0 of each generation also sends every metrics row it writes
(:func:`publish_row`: ``metrics/<i>``, signed), and every node its sample log's rows; the
coordinator appends them to its ``metrics.jsonl`` and sample logs as they come
(:class:`RowMirror`), so a run's progress is visible, and kept, where it is coordinated.  A node on another host writes its outputs (metrics rows while it was rank 0, its stage's final
weights under ``parts/``, timelines and sample logs under ``phases/``, error reports) into its
own run directory.  When the node process ends, however it ended, its supervisor on the same host
ships them (:func:`ship_outputs`): every file streamed to the coordinator's file server
(:func:`~skiptrain.runtime.file_channel.put_output`: not through the store, which holds values in
memory), then a manifest ``out/<node>`` of paths and SHA-256 digests in the store, signed with
the node's member key.  The coordinator assembles them in its ``RUN_DIR``
(:func:`collect_outputs`): a file whose digest does not match the signed manifest is refused,
JSON-lines files from several nodes are merged (metrics in step order, without duplicate rows),
any other file is moved into place as it is.  Logs stay on their hosts.

Failure semantics: nothing here raises on what another process wrote: a forged, malformed or
tampered value is skipped (said on stderr, or in ``rejected_writes.jsonl`` by the verifier); a
node whose outputs never arrive is named once; a metrics slot never written is skipped after
:data:`GAP_S`.  A store that goes away stops the mirror quietly (the rows are shipped at the end).
"""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from .file_channel import plain_path, put_output, server_address, sha256_of
from .membership import COORDINATOR, MAX_NODE_IDS, Verifier, open_value, raise_count, read_count, read_raw, sign, strip_tag

#: What a node ships, relative to its run directory (checkpoints and logs stay on the host).
SHIPPED = ("metrics.jsonl", "elastic.jsonl", "parts/*.safetensors", "phases/**/*", "errors/*.json")
#: What the coordinator takes, as :mod:`fnmatch` patterns (``*`` crosses folders).
ACCEPTED = ("metrics.jsonl", "elastic.jsonl", "parts/stage*.safetensors", "phases/*", "errors/node*.json")
#: A metrics slot counted but not written this long is skipped by the mirror (its writer died).
GAP_S = 10.0


def _files(root: Path) -> list[Path]:
    out = []
    for pattern in SHIPPED:
        out += [p for p in sorted(root.glob(pattern)) if p.is_file()]
    return list(dict.fromkeys(out))


def ship_outputs(store, key: bytes, coord_key: bytes, node: int, root: Path, run: str = "") -> int:
    """Send node ``node``'s outputs under ``root`` to the coordinator's file server (``coord_key``
    checks its announcement; ``run``: the run's id, which the uploads are signed for), then their
    signed manifest to the store; returns the bytes sent.  Raises ``OSError`` (no file server, a
    refusal, a link gone: its message names the fix) or the store's ``RuntimeError``."""
    address = server_address(store, coord_key)
    if address is None:
        raise OSError("the coordinator announced no file server (is it running?)")
    manifest, sent = {}, 0
    for path in _files(Path(root)):
        rel = path.relative_to(root).as_posix()
        if not plain_path(rel):
            print(f"skiptrain node {node}: not shipping {rel!r} (not a plain path): it stays in {root}",
                  file=sys.stderr, flush=True)
            continue
        try:
            manifest[rel] = put_output(address, key, node, rel, path, run)
        except OSError as e:
            raise OSError(f"the coordinator's file server at {address[0]}:{address[1]} took no {rel} ({e}); is the "
                          "coordinator running, and its --bind port + 1 open to this host?") from None
        sent += path.stat().st_size
    name = f"out/{node}"
    store.set(name, sign(key, name, json.dumps(manifest)))
    return sent


def shipped(store, verifier: Verifier | None, node: int) -> dict[str, str] | None:
    """Node ``node``'s verified manifest (path -> SHA-256), None when absent or forged."""
    name = f"out/{node}"
    if not store.check([name]):
        return None
    raw = store.get(name).decode(errors="replace")
    value = verifier.read(store, node, name) if verifier is not None else open_value(None, name, raw)
    try:
        return dict(json.loads(value)) if value is not None else None
    except (ValueError, TypeError):
        return None


def wait_shipped(store, verifier: Verifier | None, nodes, timeout_s: float, sending=None) -> set[int]:
    """Wait up to ``timeout_s`` for the manifests of ``nodes``, and beyond it as long as
    ``sending(missing nodes)`` says their uploads still bring bytes; returns those still missing."""
    end = time.time() + timeout_s
    missing = set(nodes)
    while missing and (time.time() < end or (sending is not None and sending(missing))):
        missing = {n for n in missing if shipped(store, verifier, n) is None}
        time.sleep(0.05)
    return missing


def collect_outputs(store, verifier: Verifier | None, nodes, run_dir: Path, received: Path) -> dict[int, int]:
    """Move the outputs every node of ``nodes`` shipped (uploaded under ``received/<node>``, named
    in its signed manifest) into ``run_dir``, in that order (a later node's file replaces an
    earlier one's); returns node -> files taken.  JSON-lines files are merged with what is there
    already (rows in step order, each once).  A path that is not a node's output or lies outside
    ``run_dir``, or bytes that do not match the signed digest, are refused (one line on stderr
    each)."""
    run_dir = Path(run_dir)
    lines: dict[str, list[str]] = {}
    taken = {}
    for n in nodes:
        manifest = shipped(store, verifier, n) or {}
        taken[n] = 0
        for rel, digest in sorted(manifest.items()):
            src = Path(received) / str(n) / rel
            why = _refused(run_dir, rel)
            if why is None and (not src.is_file() or sha256_of(src) != digest):
                why = "its bytes do not match the node's signed manifest"
            if why is not None:
                print(f"[coordinator] refused {rel!r} from node {n}: {why}", file=sys.stderr, flush=True)
                continue
            taken[n] += 1
            if rel.endswith(".jsonl"):
                lines.setdefault(rel, []).extend(src.read_text(errors="replace").splitlines())
                continue
            (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, run_dir / rel)
    for rel, rows in lines.items():
        _merge_lines(run_dir / rel, rows)
    return taken


def _refused(run_dir: Path, rel: str) -> str | None:
    """Why a shipped path may not be written into ``run_dir`` (None: it may)."""
    if not isinstance(rel, str) or not plain_path(rel) or not any(fnmatch.fnmatchcase(rel, pat) for pat in ACCEPTED):
        return "not one of the outputs a node ships"
    if not (run_dir / rel).resolve().is_relative_to(run_dir.resolve()):
        return "outside the run directory"
    return None


def _merge_lines(dest: Path, rows: list[str]) -> None:
    """``dest`` with ``rows`` added: every distinct line once, in order of their ``step`` (or
    ``iteration``) field where they have one (hosts' clocks may differ: never by time)."""
    have = dest.read_text().splitlines() if dest.is_file() else []
    seen, out = set(), []
    for line in have + rows:
        if line.strip() and line not in seen:
            seen.add(line)
            out.append(line)

    def when(line: str) -> float:
        try:
            d = json.loads(line)
            return float(d.get("step", d.get("iteration", 0.0)))
        except (ValueError, TypeError, AttributeError):
            return 0.0

    out.sort(key=when)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(line + "\n" for line in out))


def collect_run_outputs(store, secret: str, run_dir: Path, files, wait_s: float) -> None:
    """Coordinator side, at the end of a run across hosts: wait up to ``wait_s`` for the outputs
    of the last generation's members (longer while their uploads to ``files``, the coordinator's
    :class:`~skiptrain.runtime.file_channel.FileServer`, still bring bytes), then take every
    node's that arrived; the file server takes no more outputs after that."""
    from .recovery import generation_record, latest_generation
    from .membership import coordinator_key

    verifier = Verifier(secret, Path(run_dir) / "rejected_writes.jsonl")
    key = coordinator_key(secret)
    rec = generation_record(store, latest_generation(store, key), key)
    missing = wait_shipped(store, verifier, (rec or {}).get("alive", []), wait_s, files.sending)
    if missing:
        print(f"[coordinator] no outputs arrived from node(s) {sorted(missing)}", file=sys.stderr, flush=True)
    alive = set((rec or {}).get("alive", []))
    top = read_count(store, "nodes/next", MAX_NODE_IDS) or 1 + max(alive, default=-1)   # (a forged counter: the alive ones)
    everyone = range(top)                                   # the last generation's last: its stage weights win
    received, files.outputs = files.outputs, None           # (a late upload is refused: 404)
    collect_outputs(store, verifier, [n for n in everyone if n not in alive] + sorted(alive), run_dir, received)


def claim_slot(store, prefix: str) -> int:
    """The next slot of the signed log ``prefix`` (``prefix/0``, ``prefix/1``, ...)."""
    return int(store.add(f"{prefix}/n", 1)) - 1


def write_slot(store, key: bytes | None, node: int, prefix: str, i: int, payload: dict) -> None:
    """Slot ``i`` of ``prefix``: ``payload`` from ``node``, signed with its member key."""
    name = f"{prefix}/{i}"
    store.set(name, sign(key, name, json.dumps({**payload, "node": node})))


def publish_row(store, key: bytes | None, node: int, line: str, file: str = "metrics.jsonl") -> None:
    """Node side: one row for the coordinator's ``file`` (``metrics.jsonl``, or the node's own
    sample log), signed."""
    write_slot(store, key, node, "metrics", claim_slot(store, "metrics"), {"row": line, "file": file})


def mirrored_file(run_dir: Path, node: int, file) -> Path | None:
    """Where in ``run_dir`` a row node ``node`` sent for ``file`` goes: ``metrics.jsonl``, or its
    own ``phases/<phase>/samples_node<node>.jsonl``; None for any other file."""
    parts = file.split("/") if isinstance(file, str) else []
    ok = file == "metrics.jsonl" or (len(parts) == 3 and parts[0] == "phases" and parts[1] not in ("", ".", "..")
                                     and parts[2] == f"samples_node{node}.jsonl")
    return run_dir / file if ok and _refused(run_dir, file) is None else None


class RowPublisher:
    """Node side: :func:`publish_row` from a thread of its own, on a store connection of its own
    (made in that thread).  A row that cannot be sent is dropped here: it is in the node's own
    file, which is shipped when the node ends."""

    def __init__(self, host: str, port: int, key: bytes | None, node: int):
        self.host, self.port, self.key, self.node = host, port, key, node
        self.queue: queue.Queue[tuple[str, str] | threading.Event] = queue.Queue()
        threading.Thread(target=self._loop, name="row-publisher", daemon=True).start()

    def put(self, line: str, file: str = "metrics.jsonl") -> None:
        self.queue.put((line, file))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every row put so far was sent (or dropped); False after ``timeout_s``."""
        done = threading.Event()
        self.queue.put(done)
        return done.wait(timeout_s)

    def _loop(self) -> None:
        import torch.distributed as dist

        store = None
        while True:
            item = self.queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            line, file = item
            try:
                store = store or dist.TCPStore(self.host, self.port, 1, is_master=False, wait_for_workers=False,
                                               timeout=timedelta(seconds=30))
                publish_row(store, self.key, self.node, line, file)
            except Exception:  # noqa: BLE001 - the coordinator's store is away: the row waits for the shipping
                store = None


class SlotReader:
    """Coordinator side: the slots of a signed log (:func:`claim_slot`, :func:`write_slot`) in
    order, each once.  A slot whose tag does not verify with its node's key is dropped (logged by
    the verifier); a slot counted but not written is waited for, then skipped after
    :data:`GAP_S` (its writer died between the two).

    The position read up to is kept in the store (``coord/slots/<prefix>``, signed by the
    coordinator) before the slots read are deleted, so a coordinator that takes a live run over
    goes on where its predecessor stopped.  (A predecessor that died after saving the position
    but before it used what it read loses that poll's slots: rows come back with the nodes'
    shipped files at the end, merged without duplicates; a checkpoint part lost so leaves its
    step uncommitted.  One that died between saving and deleting leaves those slots in memory.)"""

    def __init__(self, store, verifier: Verifier, prefix: str):
        self.store, self.verifier, self.prefix = store, verifier, prefix
        self.position_key = f"coord/slots/{prefix}"
        self.next = self._saved_position()
        self.top = 0                     # the slots counted at the last poll
        self.missing: dict[int, float] = {}

    def _saved_position(self) -> int:
        raw = read_raw(self.store, self.position_key)
        value = open_value(self.verifier.key(COORDINATOR), self.position_key, raw) if raw is not None else None
        return int(value) if value is not None and value.isdigit() else 0

    def caught_up(self) -> bool:
        """Whether the last poll took every slot counted by then."""
        return self.next >= self.top

    def poll(self) -> list[tuple[int, dict]]:
        """The (node, payload) of every slot ready since the last call; raises what the store raises."""
        top = read_count(self.store, f"{self.prefix}/n")
        if top is None:          # absent, or forged by a process without the secret (the writers'
            if read_raw(self.store, f"{self.prefix}/n") is not None:        # `add` fails on it): put back
                raise_count(self.store, f"{self.prefix}/n", self.top)
            return []
        self.top = top
        out, first = [], self.next
        for i in range(self.next, top):
            got = self._slot(i)
            if got is None and not self.store.check([f"{self.prefix}/{i}"]) and not self._given_up(i):
                break              # (counted, not yet written: next time)
            self.next = i + 1
            self.missing.pop(i, None)
            if got is not None:
                out.append(got)
        if self.next > first:
            key = self.verifier.key(COORDINATOR)
            self.store.set(self.position_key, sign(key, self.position_key, str(self.next)))
            for i in range(first, self.next):
                self.store.delete_key(f"{self.prefix}/{i}")   # (read once: the store keeps values in memory)
        return out

    def _given_up(self, i: int) -> bool:
        since = self.missing.setdefault(i, time.monotonic())
        return time.monotonic() - since > GAP_S

    def _slot(self, i: int) -> tuple[int, dict] | None:
        name = f"{self.prefix}/{i}"
        if not self.store.check([name]):
            return None
        raw = self.store.get(name).decode(errors="replace")
        try:
            node = int(json.loads(strip_tag(raw))["node"])
        except (ValueError, KeyError, TypeError, OverflowError):
            return None
        value = self.verifier.read(self.store, node, name)
        try:
            payload = json.loads(value) if value is not None else None
        except ValueError:
            return None
        return (node, payload) if isinstance(payload, dict) else None


class Poller:
    """A thread calling :meth:`poll` every ``poll_s`` seconds while in its ``with`` block, and
    :meth:`final_poll` once at its end, in that thread (the block's end waits for it: nothing
    polls from two threads).  A poll that raises is said in one line; the thread goes on."""

    poll_s = 0.25

    def __enter__(self):
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            self._guarded(self.poll)
        self._guarded(self.final_poll)

    def _guarded(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a bad value from a peer must not stop the thread
            print(f"[coordinator] {type(self).__name__}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)

    def poll(self) -> None:
        raise NotImplementedError

    def final_poll(self) -> None:
        self.poll()


def iteration_row(line: str) -> tuple[str, int] | None:
    """(phase, step) of a ``metrics.jsonl`` line that records an iteration (not a validation
    point), else None."""
    try:
        d = json.loads(line)
        return (str(d.get("phase")), int(d["step"])) if isinstance(d, dict) and "val_loss" not in d else None
    except (ValueError, KeyError, TypeError):
        return None


def recorded_iterations(path: Path, tail_bytes: int = 1 << 16) -> set[tuple[str, int]]:
    """The iterations the last ``tail_bytes`` of the metrics file ``path`` record."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return set()
    return {k for k in map(iteration_row, lines) if k is not None}


class RowMirror(Poller):
    """Coordinator side: a thread that appends the rows nodes publish to the files of
    ``run_dir`` they name (:func:`mirrored_file`) as they come (a row whose tag does not verify
    with its node's key is dropped, logged by the verifier).  A ``recovered`` row of an
    iteration already recorded (its first rank 0 wrote it, then died) is dropped."""

    def __init__(self, store, verifier: Verifier, run_dir: Path):
        self.slots = SlotReader(store, verifier, "metrics")
        self.run_dir = Path(run_dir)
        self.iterations = recorded_iterations(self.run_dir / "metrics.jsonl")

    def poll(self) -> None:
        try:
            got = self.slots.poll()
        except Exception:  # noqa: BLE001 - the store is going away with the run
            return
        rows: dict[Path, list[str]] = {}
        for node, p in got:
            dest = mirrored_file(self.run_dir, node, p.get("file", "metrics.jsonl"))
            if dest is not None and "row" in p and not self._second(dest, str(p["row"])):
                rows.setdefault(dest, []).append(str(p["row"]))
        for dest, lines in rows.items():
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "a") as f:
                f.write("".join(r + "\n" for r in lines))

    def _second(self, dest: Path, line: str) -> bool:
        """Whether ``line`` is a second row of an iteration of ``metrics.jsonl`` (noted otherwise)."""
        key = iteration_row(line) if dest.name == "metrics.jsonl" else None
        if key is None:
            return False
        if key in self.iterations and json.loads(line).get("recovered"):
            return True
        self.iterations.add(key)
        return False
