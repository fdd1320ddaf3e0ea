"""Which torchrun node a lost peer was on, said in one line instead of a screen of tracebacks.

When a node dies mid-run, every collective on the other nodes fails with the backend's
own error: gloo's "Connection closed by peer [10.0.0.2]:43121" (or reset / broken pipe),
NCCL's "remote process exited or there was a network error". Each rank then prints its
traceback and torchrun's summary prints them again -- hundreds of lines naming ports. So
at startup every rank records where it runs (`Placement`: torchrun's node rank GROUP_RANK,
host name and address, gathered once with the banner), and when training fails with a
lost-peer error (`is_peer_loss`) the rank writes its traceback to a log file and says in
one line which node(s) the peer was on (`describe`, from the address in the message where
the backend gives one; the other nodes otherwise) and where the log is.

Why not a heartbeat through torchrun's store: the rendezvous store lives on one node (the
one that may have died), and a rank frozen in a collective could not answer anyway; the
error the backend raises is what every survivor sees first.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import traceback

import torch.distributed as dist

# the backends' words for a peer that went away (gloo's transport, NCCL's remote error)
_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
)
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs: torchrun's node rank, the host's name and address."""

    rank: int
    node: int
    host: str
    address: str


def here(rank: int) -> Placement:
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "unknown"
    return Placement(rank, int(os.environ.get("GROUP_RANK", 0)), host, address)


def gather_placements() -> list[Placement]:
    """Every rank's placement (one all_gather_object, at startup)."""
    placements = [None] * dist.get_world_size()
    dist.all_gather_object(placements, here(dist.get_rank()))
    return placements


def is_peer_loss(e: BaseException) -> bool:
    """Whether `e` is the backend's error for a peer that went away (module doc)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(word in text for word in _LOST)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def describe(e: BaseException, placements: list[Placement], me: Placement) -> str:
    """Which node(s) the lost peer was on: those with the address in the message (not this
    node), or every other node when the message has none or it matches several."""
    nodes: dict[int, list[Placement]] = {}
    for p in placements:
        nodes.setdefault(p.node, []).append(p)
    others = {n: ps for n, ps in nodes.items() if n != me.node}
    match = _ADDRESS.search(str(e))
    if match is not None:
        hit = {n: ps for n, ps in others.items() if ps[0].address == match.group(1)}
        others = hit or others
    if not others:
        return "a rank of this node"
    parts = [
        f"node {n} ({ps[0].host}, {ps[0].address}: {_ranks([p.rank for p in ps])})"
        for n, ps in sorted(others.items())
    ]
    return " or ".join(parts)


def report(e: BaseException, placements: list[Placement], me: Placement, log_dir: str) -> str:
    """Write `e`'s traceback to `log_dir`/upipe-train-rank<R>.log; the one line to print."""
    path = os.path.join(log_dir, f"upipe-train-rank{me.rank}.log")
    with open(path, "w") as f:
        f.write("".join(traceback.format_exception(e)))
    return (
        f"upipe train: rank {me.rank} (node {me.node}, {me.host}) lost its peers: "
        f"{describe(e, placements, me)} went away (the node died, was stopped, or its "
        f"network failed); this rank's traceback: {path}"
    )
