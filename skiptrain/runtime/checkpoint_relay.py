"""Job checkpoints of a run across hosts: every node sends its part, the coordinator commits.

Nodes on other hosts share no file system with the coordinator, so a job checkpoint
(:mod:`~skiptrain.runtime.job_checkpoint`) is committed in the coordinator's run directory:

* **node side** (:class:`PartShipper`, the checkpoint manager's
  :class:`~skiptrain.checkpoint.manager.PartSink`): each writer writes its part to its own disk
  as it would in a shared directory, waits until the rows it published so far are sent, then,
  from its checkpoint writer thread, streams the part's two files to the coordinator's file
  server (:mod:`~skiptrain.runtime.file_channel`: not through the store, which holds values in
  memory), sends a slot of the signed ``ckpt`` log naming them with their SHA-256 (on a store
  connection of its own), and deletes its local copy.  The lowest writer also sends the commit's record: the writers, the job's position, the
  layout and the names of every tensor the parts must cover.
* **coordinator side** (:class:`CheckpointCollector`, a thread that also runs the
  :class:`~skiptrain.runtime.shipping.RowMirror`): takes each verified part into
  ``ROOT/.tmp-step-N/`` (a node may send only its own rank's two files), and once the record and
  every writer's part of a step are there, and every row the nodes sent before them (metrics,
  sample logs) is in the run directory, commits it with
  :func:`~skiptrain.checkpoint.writer.commit`: metadata fsynced, the directory renamed into
  place, ``LATEST`` replaced, old steps pruned, as in one directory, so a crash at any moment
  leaves the previous ``LATEST`` loadable.  A step some writer never sent stays uncommitted and is
  dropped once a later step of its phase commits.  Every commit is then published
  (:func:`publish_checkpoint`: ``ckpt/latest/<phase>``, the files' digests signed by the
  coordinator; the files themselves hard-linked aside and served by its file server), which a
  node fetches (:func:`fetch_checkpoint`) to restart a stage that
  lost every replica; the checkpoint a resumed run starts from stays published as
  ``ckpt/resume/<phase>`` for the whole run, for every node that joins it.

Failure semantics: nothing here raises on what another process wrote: a forged slot is dropped
(the verifier logs it), bytes that do not match their signed digest are refused (one line), a
commit that fails its checks is refused (one line) and leaves the previous ``LATEST``.  A node
that cannot reach the coordinator says so in one line and leaves that step uncommitted; the run
goes on.  Checkpoint bytes never pass through the store: the coordinator holds none of them in
memory, and uploads no slot names are removed once a later step commits.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from ..checkpoint import store as ckpt_store
from ..checkpoint.format import CheckpointError, step_dir_name, tmp_dir_name
from ..checkpoint.writer import commit, data_name, part_name
from .file_channel import FileServer, get_file, put_file, server_address, sha256_of
from .membership import Verifier, coordinator_key, open_value, sign
from .shipping import Poller, RowMirror, SlotReader, claim_slot, write_slot

LOG = "ckpt"


class PartShipper:
    """Node side (see the module doc): the sink of node ``node``'s checkpoint parts of ``phase``:
    the files to the coordinator's file server, the slots naming them to the store at
    ``host:port`` (``coord_key`` checks the server's announced address; ``run``: the run's id, which
    its uploads are signed for); runs on the checkpoint writer's thread."""

    def __init__(self, host: str, port: int, key: bytes | None, node: int, phase: str,
                 flush_rows: Callable[[], Any] | None = None, coord_key: bytes | None = None, run: str = ""):
        self.host, self.port, self.key, self.node, self.phase = host, port, key, node, phase
        self.flush_rows, self.coord_key, self.run = flush_rows, coord_key, run
        self.store = None

    def _store(self):
        import torch.distributed as dist

        if self.store is None:
            self.store = dist.TCPStore(self.host, self.port, 1, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
        return self.store

    def _send(self, step: int, payload: dict) -> bool:
        try:
            st = self._store()
            write_slot(st, self.key, self.node, LOG, claim_slot(st, LOG), {"phase": self.phase, "step": step, **payload})
            return True
        except Exception as e:  # noqa: BLE001 - the coordinator or the link is gone: this step stays uncommitted
            self.store = None
            print(f"skiptrain node {self.node}: could not send checkpoint step {step} to the coordinator "
                  f"({str(e).splitlines()[0][:120]}); it stays uncommitted", file=sys.stderr, flush=True)
            return False

    def part(self, step: int, rank: int, tmp: Path) -> None:
        files = {}
        try:
            address = server_address(self._store(), self.coord_key)
            if address is None:
                raise OSError("the coordinator announced no file server")
            for name in (part_name(rank), data_name(rank)):
                src = tmp / name
                if not src.is_file():
                    src.write_bytes(b"")
                files[name] = put_file(address, self.key, self.node, self.phase, step, src, self.run)
        except Exception as e:  # noqa: BLE001 - said by _send below
            self.store = None
            files = {}
            print(f"skiptrain node {self.node}: could not send its checkpoint part of step {step} "
                  f"({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
        if files and self.flush_rows is not None:
            self.flush_rows()                  # (the rows of the iterations saved reach the store first)
        if files:
            self._send(step, {"kind": "part", "files": files})
        shutil.rmtree(tmp, ignore_errors=True)           # (the coordinator holds it now)

    def commit(self, step: int, ranks: list[int], state: dict[str, Any], layout: dict[str, Any],
               names: list[str]) -> None:
        self._send(step, {"kind": "commit", "ranks": list(ranks), "state": state, "layout": layout, "names": names})


class CheckpointCollector(Poller):
    """Coordinator side (see the module doc): a thread taking shipped parts into the checkpoint
    root of their phase (``files.roots``) and committing complete steps (``keep`` newest kept);
    ``key`` signs what it publishes, ``files`` (:func:`open_file_server`) receives and serves."""

    def __init__(self, store, verifier: Verifier, key: bytes | None, files: FileServer, keep: int,
                 mirror: RowMirror | None = None):
        self.store, self.key, self.files, self.keep, self.mirror = store, key, files, keep, mirror
        self.roots = dict(files.roots)
        self.slots = SlotReader(store, verifier, LOG)
        self.pending: dict[tuple[str, int], dict] = {}
        self.committed: list[Path] = []
        self.last: dict[str, int] = {}            # phase -> its newest committed step
        for root in self.roots.values():
            ckpt_store.clean_stale(root)            # (what an earlier coordinator left uncommitted)

    def final_poll(self) -> None:
        self.poll(final=True)

    def poll(self, final: bool = False) -> None:
        """Checkpoint slots, then rows: a node sends the rows of the iterations it saves before
        its part, so a step commits once the rows counted by then are taken, and the run
        directory holds every row up to its newest checkpoint.  (``final``: the run is over and
        every node's own files are collected anyway: commit what is complete.)"""
        try:
            got = self.slots.poll()
        except Exception:  # noqa: BLE001 - the store is going away with the run
            return
        for node, payload in got:
            try:
                self.take(node, payload)
            except (TypeError, ValueError, KeyError, AttributeError, OSError) as e:
                self._refuse(node, "a checkpoint slot", f"{type(e).__name__}: {str(e)[:160]}")
        if self.mirror is not None:
            self.mirror.poll()
            if not self.mirror.slots.caught_up() and not final:
                return                  # (a row slot still to come: commit next time)
        self.commit_ready()

    def _refuse(self, node: int, what: str, why: str) -> None:
        print(f"[coordinator] refused {what} from node {node}: {why}", file=sys.stderr, flush=True)

    def take(self, node: int, p: dict) -> None:
        phase, step, kind = p.get("phase"), p.get("step"), p.get("kind")
        if not isinstance(phase, str) or phase not in self.roots or not isinstance(step, int) or step < 0:
            return self._refuse(node, "a checkpoint slot", f"phase {phase!r} / step {step!r} is not of this job")
        if step <= self.last.get(phase, -1):
            return self._refuse(node, f"a checkpoint slot of step {step}", "a newer step is committed already")
        if kind == "commit" and not (isinstance(p.get("ranks"), list) and p["ranks"] and
                                     all(isinstance(r, int) for r in p["ranks"]) and isinstance(p.get("names"), list)):
            return self._refuse(node, f"the commit record of step {step}", "malformed")
        pend = self.pending.setdefault((phase, step), {"parts": set(), "commit": None})
        if kind == "commit":
            pend["commit"], pend["from"] = p, node
        elif kind == "part" and self._take_files(node, phase, step, p.get("files")):
            pend["parts"].add(node)

    def _take_files(self, node: int, phase: str, step: int, files) -> bool:
        """Node ``node``'s part of ``step`` (uploaded to the file server), its bytes checked against
        the signed digests, into the step's temporary directory; False (said once) when refused."""
        if not isinstance(files, dict) or set(files) != {part_name(node), data_name(node)}:
            self._refuse(node, f"checkpoint part of step {step}", "a node sends its own rank's two files only")
            return False
        got = self.files.incoming(phase, node, step)
        for name, digest in files.items():
            if not (got / name).is_file() or sha256_of(got / name) != digest:
                self._refuse(node, f"checkpoint part of step {step}", f"{name}: its bytes do not match the signed digest")
                shutil.rmtree(got, ignore_errors=True)
                return False
        tmp = self.roots[phase] / tmp_dir_name(step)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.replace(got / name, tmp / name)
            ckpt_store.fsync_path(tmp / name)
        shutil.rmtree(got, ignore_errors=True)
        return True

    def commit_ready(self) -> None:
        """Commit every step whose record and parts are all here, oldest first."""
        for (phase, step) in sorted(self.pending, key=lambda k: k[1]):
            pend = self.pending.get((phase, step))
            rec = (pend or {}).get("commit")
            if rec is None or not set(rec.get("ranks") or [-1]) <= pend["parts"]:
                continue
            del self.pending[(phase, step)]
            root = self.roots[phase]
            try:
                if pend["from"] != min(rec["ranks"]):
                    raise CheckpointError(f"the commit of step {step} came from node {pend['from']}, not its lowest writer")
                path = commit(root, step, [int(r) for r in rec["ranks"]], None, dict(rec["state"]), dict(rec["layout"]),
                              self.keep, timeout=1.0, expect=list(rec["names"]))
            except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
                print(f"[coordinator] checkpoint step {step} not committed: {e}", file=sys.stderr, flush=True)
                continue
            self._drop_older(phase, step)
            self.committed.append(path)
            self.last[phase] = step
            publish_checkpoint(self.store, self.key, self.files, phase, path)
            print(f"[coordinator] committed checkpoint {path} (parts of nodes {sorted(pend['parts'])})", flush=True)

    def _drop_older(self, phase: str, step: int) -> None:
        """Steps of ``phase`` older than the one just committed will never complete: their writers
        left (a new generation saves anew)."""
        for key in [k for k in self.pending if k[0] == phase and k[1] < step]:
            del self.pending[key]
            shutil.rmtree(self.roots[phase] / tmp_dir_name(key[1]), ignore_errors=True)
        for d in (self.roots[phase] / ".incoming").glob("*/*"):     # (uploads no slot ever named)
            if d.name.isdigit() and int(d.name) <= step:
                shutil.rmtree(d, ignore_errors=True)


def open_file_server(store, secret: str, roots: dict[str, Path], outputs: Path | None = None,
                     address: tuple[str, int] = ("127.0.0.1", 0), run: str = "") -> FileServer:
    """The coordinator's file server of run ``run`` for checkpoint parts under ``roots`` (phase
    name -> checkpoint root) and the nodes' final outputs under ``outputs``, serving again what a
    coordinator this one took over from published, announced in ``store`` (the caller closes it)."""
    for root in roots.values():
        Path(root).mkdir(parents=True, exist_ok=True)
    files = FileServer(address[0], secret, roots, address[1], outputs=outputs, run=run)
    for phase, root in files.roots.items():
        for d in sorted((root / ".published").glob("*/step-*")):
            if ckpt_store.step_of(d.name) is not None:
                files.publish(d.parent.name, phase, ckpt_store.step_of(d.name), d)
    files.announce(store)
    return files


@contextmanager
def hosts_file_server(job, store, secret: str, roots: dict[str, Path]):
    """:func:`open_file_server` for a coordinator of hosts, next to its store (port + 1), taking
    the nodes' outputs under ``RUN_DIR/.shipped``; closed when the block ends, and what is left
    under ``.shipped`` then (uploads no collection took) removed."""
    address = (store.host, store.port + 1 if store.port < 65535 else 0)
    outputs = Path(job.run_dir) / ".shipped"
    files = open_file_server(store, secret, roots, outputs, address, job.run_id)
    try:
        yield files
    finally:
        files.close()
        shutil.rmtree(outputs, ignore_errors=True)



@contextmanager
def coordinator_relays(job, store, secret: str, files: FileServer):
    """A coordinator of hosts while the run goes on: the metrics rows its nodes send go to its
    ``metrics.jsonl`` (:class:`~skiptrain.runtime.shipping.RowMirror`), their checkpoint parts are
    committed under ``files.roots`` (phase name -> checkpoint root), and the checkpoint a resumed
    job starts from is published for them."""
    from ..config import config_from_dict

    run_dir = Path(job.run_dir)
    verifier = Verifier(secret, run_dir / "rejected_writes.jsonl")
    keep = config_from_dict(job.config).checkpoint.keep
    with CheckpointCollector(store, verifier, coordinator_key(secret), files, keep, RowMirror(store, verifier, run_dir)):
        if job.resume:
            publish_checkpoint(store, coordinator_key(secret), files, job.phases[int(job.resume["phase"])].name,
                               Path(job.resume["path"]), which="resume")
        yield


def _checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).iterdir() if p.is_file())


def publish_checkpoint(store, key: bytes | None, files: FileServer, phase: str, path: Path,
                       which: str = "latest") -> None:
    """Make the committed checkpoint ``path`` of ``phase`` the one nodes fetch as ``which``
    (``latest``: the newest commit; ``resume``: the one the run resumed from, for the whole run):
    its files hard-linked (copied across file systems) under the phase's root,
    ``.published/<which>/step-N``, so pruning the checkpoint does not take them away, served by
    ``files``, and ``ckpt/<which>/<phase>`` = their SHA-256 digests, signed; then the previous
    one's links are removed."""
    name = f"{LOG}/{which}/{phase}"
    step = ckpt_store.step_of(Path(path).name)
    dest = files.roots[phase] / ".published" / which / step_dir_name(step)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in _checkpoint_files(path):
        try:
            os.link(f, tmp / f.name)
        except OSError:                  # (another file system, or a root that takes no links: a copy)
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)   # (a step of the same number an earlier branch published)
    tmp.rename(dest)
    digests = {f.name: sha256_of(f) for f in _checkpoint_files(dest)}
    files.publish(which, phase, step, dest)
    store.set(name, sign(key, name, json.dumps({"step": step, "files": digests})))
    for old in dest.parent.iterdir():
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)


def _published(store, key: bytes | None, name: str) -> dict | None:
    """The signed record at ``name`` (None: absent); raises when it is not the coordinator's."""
    if not store.check([name]):
        return None
    value = open_value(key, name, store.get(name).decode(errors="replace"))
    try:
        rec = json.loads(value) if value is not None else None
    except ValueError:
        rec = None
    if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("files"), dict)):
        raise CheckpointError(f"the published checkpoint {name} is not signed by the run's coordinator")
    return rec


def fetch_checkpoint(store, key: bytes | None, phase: str, dest_root: Path, which: str = "latest",
                     tries: int = 3) -> Path | None:
    """Node side: the checkpoint the coordinator published for ``phase`` as ``which``, downloaded
    from its file server into ``dest_root/step-N`` (every file checked against the coordinator's
    signed digest, fsynced before the rename); None when none was published.  Raises
    :class:`CheckpointError` when no consistent copy could be had."""
    name = f"{LOG}/{which}/{phase}"
    for _ in range(tries):
        rec = _published(store, key, name)
        if rec is None:
            return None
        dest = Path(dest_root) / step_dir_name(rec["step"])
        if dest.is_dir() and all((dest / f).is_file() and sha256_of(dest / f) == d for f, d in rec["files"].items()):
            return dest
        tmp = Path(dest_root) / tmp_dir_name(rec["step"])
        tmp.mkdir(parents=True, exist_ok=True)
        if _download(server_address(store, key), which, phase, rec, tmp):
            ckpt_store.fsync_path(tmp)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
            for old in Path(dest_root).glob("step-*"):           # (only the newest copy is kept)
                if old != dest:
                    shutil.rmtree(old, ignore_errors=True)
            return dest
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(f"could not fetch the published checkpoint of phase {phase!r} from the coordinator "
                          f"in {tries} tries")


def _download(address, which: str, phase: str, rec: dict, tmp: Path) -> bool:
    """Every file of the published record ``rec`` into ``tmp``, each matching its digest."""
    if address is None:
        return False
    for fname, digest in rec["files"].items():
        if "/" in fname:
            return False
        try:                                     # (replaced by a newer one meanwhile: again)
            if get_file(address, which, phase, rec["step"], fname, tmp / fname) != digest:
                return False
        except OSError:
            return False
        ckpt_store.fsync_path(tmp / fname)
    return True


def fetch_resume_point(job, store):
    """``job`` with its resume checkpoint copied to this host (a node on another host than its
    coordinator: the coordinator published it, :func:`publish_checkpoint`)."""
    import dataclasses

    from ..checkpoint.reader import CheckpointReader
    from .membership import secret_from_env

    phase = job.phases[int(job.resume["phase"])].name
    dest = Path(job.run_dir) / "checkpoints" / phase / "fetched"
    path = fetch_checkpoint(store, coordinator_key(secret_from_env()), phase, dest, which="resume")
    if path is None or CheckpointReader(path).step != int(job.resume["iteration"]):
        raise CheckpointError(f"the coordinator has not published the checkpoint of iteration {job.resume['iteration']} "
                              "this job resumes from; restart the coordinator with --resume")
    return dataclasses.replace(job, resume={**job.resume, "path": str(path)})
