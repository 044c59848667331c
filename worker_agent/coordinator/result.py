"""What a finished generation reports: its tokens and text, timings, verified receipts, audit
material, heals and speculation figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker_agent.coordinator.heal import HealRecord
from worker_agent.coordinator.pipeline import AuditGap
from worker_agent.protocol.audit import AuditMaterial
from worker_agent.protocol.coverage import JobVerification
from worker_agent.protocol.receipts import Receipt

if TYPE_CHECKING:  # only named in annotations: proof.py and session.py import nothing from here
    from worker_agent.coordinator.proof import Proof
    from worker_agent.coordinator.session import GenerationState


@dataclass
class GenerationResult:
    session: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" or "length"
    token_times: list[float]  # seconds from the request's start to each committed token
    elapsed: float  # seconds for the whole request, receipts included
    steps: int  # forward passes through the pipeline
    receipts: list[Receipt] = field(default_factory=list)
    verification: JobVerification | None = None
    verification_error: str = ""  # why the receipts failed verification (non-strict streams only)
    verification_culprit: str | None = None  # the node that failure is unambiguously on, if any
    audits: list[AuditMaterial] = field(default_factory=list)  # one per audited stage, in stage order
    audit_missing: list[AuditGap] = field(default_factory=list)  # audited stages without material, and who owed it
    heals: list[HealRecord] = field(default_factory=list)  # the stages that failed under it, and when
    drafted: int = 0  # draft tokens the pipeline verified
    accepted: int = 0  # drafts accepted (committed as drafted)
    speculation: dict = field(default_factory=dict)  # the router's view at the end (acceptance, plan)
    cached_tokens: int = 0  # prompt positions the stages held already from an earlier request (prefix reuse)

    @classmethod
    def of(
        cls, session: str, state: GenerationState, proof: Proof, *, heals: list[HealRecord], elapsed: float
    ) -> GenerationResult:
        """The result of a session that ended in ``state``, proven (or not) by ``proof``."""
        return cls(
            session=session,
            text=state.text,
            token_ids=state.generated,
            prompt_tokens=len(state.request.prompt_ids),
            finish_reason=state.finish_reason or "length",
            token_times=state.token_times,
            elapsed=elapsed,
            steps=state.steps,
            receipts=proof.receipts,
            verification=proof.verification,
            verification_error=proof.error,
            verification_culprit=proof.culprit,
            audits=proof.audits,
            audit_missing=proof.audit_missing,
            heals=heals,
            drafted=state.drafted,
            accepted=state.accepted,
            speculation=state.speculation,
            cached_tokens=state.cached,
        )

    @property
    def acceptance(self) -> float | None:
        """The share of verified drafts accepted; None without any."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def to_json(self) -> dict:
        return {
            "session": self.session,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "token_times": [round(t, 4) for t in self.token_times],
            "ttft_s": round(self.ttft, 4) if self.ttft is not None else None,
            "elapsed_s": round(self.elapsed, 4),
            "steps": self.steps,
            "verified": self.verification is not None,
            "receipts": [receipt.to_json() for receipt in self.receipts],
            "audits": [
                {
                    "stage": audit.stage,
                    "node": audit.node,
                    "layer_start": audit.layer_start,
                    "layer_end": audit.layer_end,
                    "steps": len(audit.steps),
                    "tokens": audit.tokens,
                }
                for audit in self.audits
            ],
            "audit_missing": [vars(gap) for gap in self.audit_missing],
            "heals": [heal.to_json() for heal in self.heals],
            "drafted": self.drafted,
            "accepted": self.accepted,
            "speculation": self.speculation,
        }
