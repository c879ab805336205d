"""Network topologies: nodes with a location and a compute speed, plus latency/bandwidth matrices.

A :class:`Topology` is what the scheduler and the simulator know about the machines:

* ``nodes[i]`` is node ``i``: a location name (for network look-ups) and a relative compute
  ``speed`` (1.0 = the cost model's reference device; 2.0 runs every task in half the time);
* ``latency_s[a][b]`` is the one-way latency from node ``a`` to node ``b`` in seconds;
* ``bandwidth_Bps[a][b]`` is the bandwidth of the directed link ``a -> b`` in bytes per second.

Sending ``n`` bytes over ``a -> b`` takes ``latency_s[a][b] + n / bandwidth_Bps[a][b]`` when the
link is otherwise idle.  The diagonal is ``0`` latency and infinite bandwidth (a node never sends
to itself in a schedule).

Sources (:func:`load_topology` accepts all of them):

* ``geo12``: the 12 public-cloud regions measured for SkipPipe (package data ``net/data/geo12.json``);
  nodes cycle through the regions in the reference order (:data:`GEO12_REFERENCE_ORDER`), so
  ``geo12`` with 20 nodes is exactly the reference's 20-node setup.  ``geo12-fixed`` is the same
  with the suspicious NL-London bandwidth (0.00024 GB/s, probably a typo) set to 0.2425 GB/s.
* ``cluster``: one location, 0.05 ms and 10 GB/s between any two nodes, all speeds 1.
* ``random`` or ``random:SEED``: a heterogeneous topology drawn from a seed (regions with random
  latencies and bandwidths, node speeds between 0.5 and 2).
* a JSON file in geo12's shape: ``locations``, ``links`` (``a``, ``b``, ``latency_ms``,
  ``bandwidth_GBps`` with GB = 2^30 bytes; links are symmetric), ``same_region``
  (``latency_ms``, ``bandwidth_GBps`` used between two nodes in one location) and optionally
  ``nodes``: a list of ``{"location": ..., "speed": ...}``.  Without ``nodes``, nodes cycle through
  ``locations``.

Location pairs without a listed link are reached by relaying (store and forward) over the path
with the smallest transfer time for a 32 MiB message; the effective link then has the summed
latency and ``1 / sum(1 / bandwidth)``.  If some pair cannot be reached at all the topology is
disconnected and :class:`TopologyError` says which.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import MAX_TOPOLOGY_NODES  # (its matrices are n x n)
from ..errors import UserError

GiB = float(2 ** 30)
#: Node order of SkipPipe's experiments (create_schedule.py): node i sits in region i mod 12.
GEO12_REFERENCE_ORDER = ["Belgium", "Canada", "Germany", "Iowa", "Japan", "LA", "NL", "Oregon",
                         "Singapore", "Taiwan", "London", "Australia"]
PRESETS = ("geo12", "geo12-fixed", "cluster", "random")
_RELAY_REF_BYTES = 32 * 2 ** 20


class TopologyError(UserError, ValueError):
    """A topology that cannot be built or used; the message says what is wrong."""


@dataclass(frozen=True)
class Node:
    """One worker: ``id`` (index into the matrices), ``location`` and relative compute ``speed``."""
    id: int
    location: str
    speed: float = 1.0


class Topology:
    """Nodes plus full ``N x N`` latency (s) and bandwidth (bytes/s) matrices; see module doc."""

    def __init__(self, nodes: Sequence[Node], latency_s: np.ndarray, bandwidth_Bps: np.ndarray,
                 name: str = "custom"):
        n = len(nodes)
        lat = np.asarray(latency_s, dtype=float)
        bw = np.asarray(bandwidth_Bps, dtype=float)
        if n == 0:
            raise TopologyError("a topology needs at least one node")
        if lat.shape != (n, n) or bw.shape != (n, n):
            raise TopologyError(f"latency/bandwidth matrices must be {n}x{n}, got {lat.shape} and {bw.shape}")
        for i, nd in enumerate(nodes):
            if nd.id != i:
                raise TopologyError(f"node ids must be 0..{n - 1} in order; node {i} has id {nd.id}")
            if not (nd.speed > 0 and math.isfinite(nd.speed)):
                raise TopologyError(f"node {i} ({nd.location}) has speed {nd.speed}; speeds must be > 0")
        off = ~np.eye(n, dtype=bool)
        if np.any(~np.isfinite(lat[off])) or np.any(~np.isfinite(bw[off])) or np.any(bw[off] <= 0):
            a, b = np.argwhere(off & (~np.isfinite(lat) | ~np.isfinite(bw) | (bw <= 0)))[0]
            raise TopologyError(
                f"topology {name!r} is disconnected: no path from node {a} ({nodes[a].location}) "
                f"to node {b} ({nodes[b].location})")
        if np.any(lat[off] < 0):
            raise TopologyError("latencies must be >= 0")
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        self.nodes = list(nodes)
        self.latency_s = lat
        self.bandwidth_Bps = bw
        self.name = name
        # Python lists for the simulator's hot loops (numpy scalar indexing is slow).
        self.lat_rows = lat.tolist()
        self.inv_bw_rows = (1.0 / bw).tolist()
        self._region_of: list[int] | None = None

    @property
    def n(self) -> int:
        return len(self.nodes)

    def speed(self, node: int) -> float:
        return self.nodes[node].speed

    def transfer_s(self, a: int, b: int, nbytes: float) -> float:
        """Time to move ``nbytes`` from ``a`` to ``b`` over an idle link (latency + bytes / bandwidth)."""
        if a == b:
            return 0.0
        return self.lat_rows[a][b] + nbytes * self.inv_bw_rows[a][b]

    def region_of(self) -> list[int]:
        """Region index of every node: the latency clusters of :func:`near_components` over the
        symmetric latency, mutual (one geo12 location per region, a node alone in its location a
        region of its own; a uniform cluster is one region).
        Computed once per topology; every process that holds the same topology gets the same
        regions (the runtime's hierarchical sync relies on that)."""
        if self._region_of is None:
            lat = np.asarray(self.latency_s, dtype=float)
            label = [0] * self.n
            for k, members in enumerate(near_components(lat + lat.T, mutual=True)):
                for m in members:
                    label[m] = k
            self._region_of = label
        return self._region_of

    def subset(self, node_ids: Sequence[int]) -> "Topology":
        """The topology restricted to ``node_ids`` (renumbered 0..len-1 in that order)."""
        idx = list(node_ids)
        nodes = [Node(i, self.nodes[j].location, self.nodes[j].speed) for i, j in enumerate(idx)]
        return Topology(nodes, self.latency_s[np.ix_(idx, idx)], self.bandwidth_Bps[np.ix_(idx, idx)],
                        name=f"{self.name}[{len(idx)}]")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: nodes and the full matrices (ms and GB/s, like geo12.json)."""
        lat = (self.latency_s * 1000.0).tolist()
        bw = (self.bandwidth_Bps / GiB)
        bw = np.where(np.isfinite(bw), bw, 0.0).tolist()
        return {"name": self.name,
                "nodes": [{"location": nd.location, "speed": nd.speed} for nd in self.nodes],
                "latency_ms": lat, "bandwidth_GBps": bw}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        nodes = [Node(i, x["location"], float(x.get("speed", 1.0))) for i, x in enumerate(d["nodes"])]
        lat = np.asarray(d["latency_ms"], dtype=float) / 1000.0
        bw = np.asarray(d["bandwidth_GBps"], dtype=float) * GiB
        n = len(nodes)
        bw[np.eye(n, dtype=bool)] = np.inf
        return cls(nodes, lat, bw, name=d.get("name", "custom"))

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, {self.n} nodes)"


def near_components(d: np.ndarray, mutual: bool = False) -> list[list[int]]:
    """Nodes grouped by a symmetric distance matrix ``d``: the connected components of the links
    no longer than 1.5x either end's nearest neighbour (``mutual``: both ends'; then a node alone
    in its location stays alone instead of joining its nearest region), each sorted, in order of
    their smallest node (geo12: one location; a uniform cluster: everything)."""
    n = len(d)
    nn = np.where(np.eye(n, dtype=bool), np.inf, d).min(axis=1) if n > 1 else np.zeros(1)
    near, near_t = d <= 1.5 * nn[:, None], d <= 1.5 * nn[None, :]
    local = (near & near_t) if mutual else (near | near_t)
    label = np.full(n, -1)
    out: list[list[int]] = []
    for root in range(n):
        if label[root] >= 0:
            continue
        label[root] = len(out)
        todo, members = [root], [root]
        while todo:
            fresh = np.nonzero(local[todo.pop()] & (label < 0))[0]
            label[fresh] = len(out)
            todo += fresh.tolist()
            members += fresh.tolist()
        out.append(sorted(members))
    return out


# --------------------------------------------------------------------------------------------
# building from a location-level spec (geo12.json shape)


def _relay_fill(lat: np.ndarray, bw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fill missing location pairs (bw == 0) by the best store-and-forward relay path."""
    n = lat.shape[0]
    have = bw > 0
    np.fill_diagonal(have, True)
    if have.all():
        return lat, bw
    inv = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), np.inf)
    np.fill_diagonal(inv, 0.0)
    L = np.where(have, lat, np.inf)
    np.fill_diagonal(L, 0.0)
    W = L + _RELAY_REF_BYTES * inv
    for k in range(n):  # Floyd-Warshall on the reference transfer time, carrying latency and 1/bw
        via = W[:, k:k + 1] + W[k:k + 1, :]
        better = via < W
        if better.any():
            W = np.where(better, via, W)
            L = np.where(better, L[:, k:k + 1] + L[k:k + 1, :], L)
            inv = np.where(better, inv[:, k:k + 1] + inv[k:k + 1, :], inv)
    with np.errstate(divide="ignore"):
        bw2 = np.where(np.isfinite(inv) & (inv > 0), 1.0 / inv, 0.0)
    np.fill_diagonal(bw2, np.inf)
    L = np.where(np.isfinite(W), L, np.inf)
    return L, bw2


def from_spec(spec: dict[str, Any], n_nodes: int | None = None,
              node_locations: Sequence[str] | None = None, speeds: Sequence[float] | None = None,
              name: str | None = None) -> Topology:
    """Build a node-level topology from a geo12-shaped location spec (see module doc).

    Node locations come from ``node_locations``, else the spec's ``nodes`` list, else cycle
    through ``spec["locations"]`` (``n_nodes`` of them, default one per location).
    """
    try:
        locations = list(spec["locations"])
        links = list(spec.get("links", []))
    except (KeyError, TypeError):
        raise TopologyError("topology spec needs a 'locations' list and a 'links' list") from None
    if not locations:
        raise TopologyError("topology spec has no locations")
    if len(set(locations)) != len(locations):
        raise TopologyError("topology spec lists a location twice")
    index = {loc: i for i, loc in enumerate(locations)}
    nl = len(locations)
    llat = np.zeros((nl, nl))
    lbw = np.zeros((nl, nl))
    for ln in links:
        try:
            a, b = index[ln["a"]], index[ln["b"]]
            lat_ms, gbps = float(ln["latency_ms"]), float(ln["bandwidth_GBps"])
        except KeyError as e:
            raise TopologyError(f"link {ln!r}: unknown location or missing field {e}") from None
        if not (0 <= lat_ms < math.inf and 0 <= gbps < math.inf):
            raise TopologyError(f"link {ln['a']}-{ln['b']}: latency and bandwidth must be finite numbers >= 0")
        llat[a, b] = llat[b, a] = lat_ms / 1000.0
        lbw[a, b] = lbw[b, a] = gbps * GiB
    llat, lbw = _relay_fill(llat, lbw)
    same = spec.get("same_region", {"latency_ms": 1.0, "bandwidth_GBps": 2.0})
    same_lat, same_bw = float(same["latency_ms"]) / 1000.0, float(same["bandwidth_GBps"]) * GiB

    node_specs = spec.get("nodes")
    if node_locations is None:
        if node_specs and n_nodes is None:
            node_locations = [x["location"] for x in node_specs]
            if speeds is None:
                speeds = [float(x.get("speed", 1.0)) for x in node_specs]
        elif node_specs:
            node_locations = [node_specs[i % len(node_specs)]["location"] for i in range(n_nodes)]
            if speeds is None:
                speeds = [float(node_specs[i % len(node_specs)].get("speed", 1.0)) for i in range(n_nodes)]
        else:
            n = n_nodes if n_nodes is not None else nl
            node_locations = [locations[i % nl] for i in range(n)]
    if n_nodes is not None and len(node_locations) != n_nodes:
        raise TopologyError(f"{len(node_locations)} node locations given for {n_nodes} nodes")
    if speeds is None:
        speeds = [1.0] * len(node_locations)
    for loc in node_locations:
        if loc not in index:
            raise TopologyError(f"node location {loc!r} is not among the topology's locations {locations}")
    ids = [index[loc] for loc in node_locations]
    n = len(ids)
    lat = llat[np.ix_(ids, ids)].copy()
    bw = lbw[np.ix_(ids, ids)].copy()
    same_mask = np.equal.outer(ids, ids)
    lat[same_mask] = same_lat
    bw[same_mask] = same_bw
    nodes = [Node(i, node_locations[i], float(speeds[i])) for i in range(n)]
    return Topology(nodes, lat, bw, name=name or spec.get("name", "custom"))


def _geo12_spec(fixed: bool = False) -> dict[str, Any]:
    text = resources.files("skiptrain.net").joinpath("data/geo12.json").read_text()
    spec = json.loads(text)
    if fixed:
        for ln in spec["links"]:
            if {ln["a"], ln["b"]} == {"NL", "London"}:
                ln["bandwidth_GBps"] = 0.2425
        spec["name"] = "geo12-fixed"
    return spec


def geo12(n_nodes: int = 20, fixed: bool = False, speeds: Sequence[float] | None = None) -> Topology:
    """SkipPipe's 12-region topology with ``n_nodes`` nodes in the reference order."""
    locs = [GEO12_REFERENCE_ORDER[i % 12] for i in range(n_nodes)]
    return from_spec(_geo12_spec(fixed), node_locations=locs, speeds=speeds,
                     name="geo12-fixed" if fixed else "geo12")


def cluster(n_nodes: int = 8, latency_ms: float = 0.05, bandwidth_GBps: float = 10.0) -> Topology:
    """A uniform fast cluster: every pair at ``latency_ms`` and ``bandwidth_GBps``, speed 1."""
    if n_nodes < 1:
        raise TopologyError("a cluster needs at least one node")
    lat = np.full((n_nodes, n_nodes), latency_ms / 1000.0)
    bw = np.full((n_nodes, n_nodes), bandwidth_GBps * GiB)
    return Topology([Node(i, "cluster") for i in range(n_nodes)], lat, bw, name="cluster")


def random_topology(n_nodes: int = 12, seed: int = 0, n_regions: int | None = None,
                    speed_range: tuple[float, float] = (0.5, 2.0)) -> Topology:
    """A heterogeneous topology from ``seed``: regions on a plane, latency grows with distance,
    bandwidth shrinks with it (with noise); same-region links 1 ms / 1 GB/s; random node speeds."""
    if n_nodes < 1:
        raise TopologyError("a random topology needs at least one node")
    rng = random.Random(seed)
    k = n_regions or max(1, min(8, (n_nodes + 2) // 3))
    pos = [(rng.random(), rng.random()) for _ in range(k)]
    locs = [f"r{i}" for i in range(k)]
    links = []
    for i in range(k):
        for j in range(i + 1, k):
            d = math.dist(pos[i], pos[j])
            links.append({"a": locs[i], "b": locs[j], "latency_ms": 5 + 150 * d * rng.uniform(0.8, 1.2),
                          "bandwidth_GBps": max(0.004, 0.25 * (1 - d / 1.5) * rng.uniform(0.3, 1.0))})
    spec = {"name": f"random:{seed}", "locations": locs, "links": links,
            "same_region": {"latency_ms": 1.0, "bandwidth_GBps": 1.0}}
    node_locs = [locs[rng.randrange(k)] for _ in range(n_nodes)]
    speeds = [round(rng.uniform(*speed_range), 3) for _ in range(n_nodes)]
    return from_spec(spec, node_locations=node_locs, speeds=speeds, name=f"random:{seed}")


def load_topology(source: str, n_nodes: int | None = None, seed: int = 0) -> Topology:
    """A preset name (``geo12``, ``geo12-fixed``, ``cluster``, ``random``, ``random:SEED``) or a JSON file."""
    if n_nodes is not None and n_nodes > MAX_TOPOLOGY_NODES:
        raise TopologyError(f"{n_nodes} nodes is more than a topology holds ({MAX_TOPOLOGY_NODES}); ask for fewer nodes")
    if source in ("geo12", "geo12-fixed"):
        return geo12(n_nodes if n_nodes is not None else 20, fixed=source == "geo12-fixed")
    if source == "cluster":
        return cluster(n_nodes if n_nodes is not None else 8)
    if source == "random" or source.startswith("random:"):
        s = seed
        if ":" in source:
            try:
                s = int(source.split(":", 1)[1])
            except ValueError:
                raise TopologyError(f"bad random topology {source!r}; use random:SEED with an integer seed") from None
        return random_topology(n_nodes if n_nodes is not None else 12, seed=s)
    p = Path(source)
    if not p.is_file():
        raise TopologyError(f"topology {source!r} is neither a preset ({', '.join(PRESETS)}) nor an existing JSON file")
    try:
        spec = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TopologyError(f"topology file {source!r} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise TopologyError(f"topology file {source!r} holds a JSON {type(spec).__name__}, not an object with "
                            "'locations' and 'links'")
    try:
        if "latency_ms" in spec and "nodes" in spec and isinstance(spec["latency_ms"], list):
            return Topology.from_dict(spec)  # a saved node-level topology (Topology.to_dict)
        return from_spec(spec, n_nodes=n_nodes, name=str(spec.get("name", p.stem)))
    except TopologyError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a field of the wrong shape
        raise TopologyError(f"topology file {source!r} is malformed ({type(e).__name__}: {e}); write 'locations' "
                            "(names), 'links' ({'a', 'b', 'latency_ms', 'bandwidth_GBps'}), optionally "
                            "'same_region' and 'nodes' ([{'location', 'speed'}])") from None
