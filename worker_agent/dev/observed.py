"""What a stage can observe of the sessions it serves: the features a node could use to tell a
challenge from a customer's job, and which must therefore be the same for both.

Everything a node learns of a job arrives as frames on its data-plane connections, so this is a
sans-I/O recorder of those frames (``Observer``), fed by whoever sits where the stage reads them,
and the features of each session it saw (``SessionView.features``)::

    observer = Observer()
    observer.hello(hello, role="coordinator", now=t)   # every HELLO the stage accepted
    observer.frame(forward, role="peer", now=t)        # every OPEN and FORWARD it was sent
    [view.features() for view in observer.sessions()]

The features, per session (``FEATURES`` names them, in order):

- the route, from the coordinator's HELLO and the connections: its ``topology``; which of the
  optional HELLO fields it carries (ticket, proof, next_url, next_ticket); whether the stage has a
  ring successor (``next_url``) and a predecessor (FORWARDs come over a ring peer's connection);
- the grants: the ticket's lifetime left when the HELLO came, and the predecessor's peer pass's;
- the job: its id's shape (a chat completion's ``chatcmpl-``, a completion's ``cmpl-``, a further
  choice's ``-<i>``, the id's length) and how many sessions it opens here;
- the session's shape: the rows of its first FORWARD (the prompt), the number of steps, the rows of
  the later steps (mean and largest: one when decoding plainly, more when speculating), how many
  steps start below the positions already held (rolled-back drafts), the last position;
- its timing: the time from the HELLO to the first FORWARD, and the mean and spread of the gaps
  between its FORWARDs;
- its inputs: the wire dtype, and the statistics of the first FORWARD's rows (mean row norm, mean,
  standard deviation and kurtosis of the entries) and of the later rows (mean row norm).

A node sees more than these, and they are the same for challenges only where the deployment makes
them so, so they are listed here and left out of the vector: the network addresses of the
coordinator's and the predecessor's connections and of the successor's URL, the neighbours' node ids
and keys (the successor's peer pass names it, a predecessor's items are signed by its key) and their
TLS certificates. A challenge's neighbours are the verifier's stand-ins (``coordinator/challenger.py``):
they look like any stage but are the verifier's nodes at the verifier's address, so only stand-ins
run on trusted nodes that also serve customers' jobs hide them.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

import torch

from worker_agent.errors import TicketError
from worker_agent.protocol import wire
from worker_agent.protocol.tickets import open_peer_pass, read_ticket

HELLO_FIELDS = ("ticket", "proof", "next_url", "next_ticket")  # the optional fields of a coordinator's HELLO
_JOB_ID = re.compile(r"(?P<kind>[a-z]+)-[0-9a-f]+(?P<choice>-[0-9]+)?")

FEATURES = (
    "ring",
    *(f"hello_{name}" for name in HELLO_FIELDS),
    "successor",
    "predecessor",
    "ticket_lifetime_s",
    "pass_lifetime_s",
    "job_chat",
    "job_completion",
    "job_choice",
    "job_id_length",
    "job_sessions",
    "prompt_rows",
    "steps",
    "decode_rows_mean",
    "decode_rows_max",
    "rollbacks",
    "positions",
    "first_forward_s",
    "gap_mean_s",
    "gap_std_s",
    "dtype_f32",
    "prompt_norm",
    "prompt_mean",
    "prompt_std",
    "prompt_kurtosis",
    "decode_norm",
)


@dataclass
class _Job:
    topology: str = ""
    hello_fields: frozenset[str] = frozenset()
    successor: bool = False
    ticket_lifetime_s: float = 0.0
    pass_lifetime_s: float = 0.0
    hello_at: float = 0.0
    sessions: list[str] = field(default_factory=list)


@dataclass
class _Session:
    predecessor: bool = False
    dtype: str = ""
    steps: list[tuple[int, int]] = field(default_factory=list)  # (start, rows) per FORWARD
    arrivals: list[float] = field(default_factory=list)
    first_rows: torch.Tensor = field(
        default_factory=lambda: torch.zeros(1, 1)
    )  # (rows, hidden) float64; set by the first FORWARD
    decode_norms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SessionView:
    """One session as the stage saw it."""

    job: str
    session: str
    topology: str
    hello_fields: frozenset[str]  # which of HELLO_FIELDS the coordinator's HELLO carried
    successor: bool  # the HELLO named a ring successor
    predecessor: bool  # its FORWARDs came over a ring peer's connection
    ticket_lifetime_s: float  # the ticket's expiry less the HELLO's arrival
    pass_lifetime_s: float  # the predecessor's peer pass's expiry less its HELLO's arrival; 0 without one
    job_sessions: int  # sessions the job opened here
    dtype: str  # the FORWARDs' wire dtype
    steps: tuple[tuple[int, int], ...]  # (start position, rows) of each FORWARD
    first_forward_s: float  # from the coordinator's HELLO to the session's first FORWARD
    gaps_s: tuple[float, ...]  # between consecutive FORWARDs of the session
    prompt_stats: tuple[float, float, float, float]  # first FORWARD's rows: mean row norm, mean, std, kurtosis
    decode_norm: float  # mean row norm of the later FORWARDs' rows; 0 without any

    def features(self) -> dict[str, float]:
        """The session's features, keyed (and ordered) as FEATURES."""
        match = _JOB_ID.fullmatch(self.job)
        kind, choice = (match["kind"], match["choice"]) if match else ("", None)
        decode = [rows for _, rows in self.steps[1:]]
        held, rollbacks = 0, 0
        for start, rows in self.steps:
            rollbacks += start < held
            held = start + rows
        gaps = self.gaps_s or (0.0,)
        mean_gap = sum(gaps) / len(gaps)
        values = {
            "ring": float(self.topology == "ring"),
            **{f"hello_{name}": float(name in self.hello_fields) for name in HELLO_FIELDS},
            "successor": float(self.successor),
            "predecessor": float(self.predecessor),
            "ticket_lifetime_s": self.ticket_lifetime_s,
            "pass_lifetime_s": self.pass_lifetime_s,
            "job_chat": float(kind == "chatcmpl"),
            "job_completion": float(kind == "cmpl"),
            "job_choice": float(choice is not None),
            "job_id_length": float(len(self.job)),
            "job_sessions": float(self.job_sessions),
            "prompt_rows": float(self.steps[0][1] if self.steps else 0),
            "steps": float(len(self.steps)),
            "decode_rows_mean": sum(decode) / len(decode) if decode else 0.0,
            "decode_rows_max": float(max(decode, default=0)),
            "rollbacks": float(rollbacks),
            "positions": float(held),
            "first_forward_s": self.first_forward_s,
            "gap_mean_s": mean_gap,
            "gap_std_s": math.sqrt(sum((gap - mean_gap) ** 2 for gap in gaps) / len(gaps)),
            "dtype_f32": float(self.dtype == "f32"),
            "prompt_norm": self.prompt_stats[0],
            "prompt_mean": self.prompt_stats[1],
            "prompt_std": self.prompt_stats[2],
            "prompt_kurtosis": self.prompt_stats[3],
            "decode_norm": self.decode_norm,
        }
        return {name: values[name] for name in FEATURES}


def row_statistics(rows: torch.Tensor) -> tuple[float, float, float, float]:
    """Mean row norm, mean, standard deviation and kurtosis of the entries of (rows, hidden)."""
    values = rows.to(torch.float64)
    mean, std = float(values.mean()), float(values.std(unbiased=False))
    kurtosis = float(((values - mean) ** 4).mean() / std**4) if std > 0 else 0.0
    return float(values.norm(dim=1).mean()), mean, std, kurtosis


class Observer:
    """Records what one stage is sent, session by session (sans-I/O: the caller says when)."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._sessions: dict[tuple[str, str], _Session] = {}

    def hello(self, hello: wire.Hello, *, role: str, now: float) -> None:
        """A HELLO the stage accepted, as the coordinator (``role``) or a ring predecessor (``peer``)."""
        job = self._jobs.setdefault(hello.job, _Job())
        if role == "peer":
            job.pass_lifetime_s = _lifetime(hello.ticket, now, peer=True)
            return
        job.topology = hello.topology
        job.hello_fields = frozenset(name for name in HELLO_FIELDS if getattr(hello, name) is not None)
        job.successor = hello.topology == "ring" and bool(hello.next_url)
        job.ticket_lifetime_s = _lifetime(hello.ticket, now, peer=False)
        job.hello_at = now

    def frame(self, message: wire.Message, *, role: str, now: float) -> None:
        """An OPEN or FORWARD the stage was sent over a connection of ``role``; others are ignored."""
        if isinstance(message, wire.Open):
            self._jobs.setdefault(message.job, _Job()).sessions.extend(message.sessions)
            return
        if type(message) is not wire.Forward:
            return
        tensor = message.tensor()  # (rows, hidden)
        row = 0
        for item in message.items:
            rows = tensor[row : row + item.count]
            row += item.count
            state = self._sessions.setdefault((message.job, item.session), _Session())
            if not state.steps:
                state.predecessor, state.dtype = role == "peer", message.dtype
                state.first_rows = rows.to(torch.float64)
            else:
                state.decode_norms.extend(rows.to(torch.float64).norm(dim=1).tolist())
            state.steps.append((item.start, item.count))
            state.arrivals.append(now)

    def sessions(self) -> list[SessionView]:
        """Every session that was sent at least one FORWARD, in the order they were first seen."""
        views = []
        for (job_id, session), state in self._sessions.items():
            job = self._jobs.get(job_id, _Job())
            arrivals = state.arrivals
            views.append(
                SessionView(
                    job=job_id,
                    session=session,
                    topology=job.topology,
                    hello_fields=job.hello_fields,
                    successor=job.successor,
                    predecessor=state.predecessor,
                    ticket_lifetime_s=job.ticket_lifetime_s,
                    pass_lifetime_s=job.pass_lifetime_s,
                    job_sessions=len(job.sessions),
                    dtype=state.dtype,
                    steps=tuple(state.steps),
                    first_forward_s=arrivals[0] - job.hello_at if job.hello_at else 0.0,
                    gaps_s=tuple(later - earlier for earlier, later in itertools.pairwise(arrivals)),
                    prompt_stats=row_statistics(state.first_rows),
                    decode_norm=sum(state.decode_norms) / len(state.decode_norms) if state.decode_norms else 0.0,
                )
            )
        return views


def _lifetime(grant: bytes | None, now: float, *, peer: bool) -> float:
    """Seconds a ticket (or peer pass) has left; 0 when there is none or it does not open."""
    if grant is None:
        return 0.0
    try:
        expires_at = open_peer_pass(grant, now=now).expires_at if peer else read_ticket(grant).expires_at
    except TicketError:
        return 0.0
    return expires_at - now
