"""A memory challenge's job and answer (``challenges.py`` runs it, ``claims.py`` judges it): what it
asks of the node, its sessions' requests, and the material of all of them stored as one answer."""

from __future__ import annotations

import dataclasses
import random

import msgpack

from marketplace.nodes.models import Node
from marketplace.placement.models import Assignment
from marketplace.verification.claims import MEMORY_DECODE_TOKENS, memory_ask, open_sessions
from marketplace.verification.models import Challenge
from marketplace.verification.prompts import prompt_pool
from marketplace.verification.traffic import TrafficShape, draw_request
from worker_agent.coordinator.challenger import ChallengeRequest
from worker_agent.coordinator.job import encode_prompt
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.protocol.audit import AuditMaterial


def memory_challenge(node: Node, assignment: Assignment) -> dict:
    """The fields of a memory challenge of ``assignment`` on ``node``: its sessions and positions
    (``claims.memory_ask``), its tokens, and the sessions the node said it had open when it was opened."""
    sessions, positions = memory_ask(node, assignment)
    return {
        "tokens": MEMORY_DECODE_TOKENS,
        "sessions": sessions,
        "positions": positions,
        "metrics": {"open_sessions": open_sessions(node)},
    }


def held_requests(challenge: Challenge, tokenizer) -> tuple[ChallengeRequest, ...]:
    """A memory challenge's sessions: greedy completions of MEMORY_DECODE_TOKENS tokens over prompts
    of texts of the prompt pool, each filling the challenge's positions (at most)."""
    shape = TrafficShape(
        "cmpl-memory", challenge.positions - challenge.tokens, challenge.tokens, temperature=0.0, speculation=False
    )
    pool = prompt_pool()
    return tuple(
        dataclasses.replace(
            draw_request(
                random.Random(challenge.seed + session),
                [shape],
                pool,
                lambda prompt, chat: encode_prompt(tokenizer, prompt, chat=chat),
                max_tokens=challenge.tokens,
            ).request,
            sampling=SamplingParams(temperature=0.0),
            speculate=False,
        )
        for session in range(challenge.sessions)
    )


def pack_materials(materials: tuple[AuditMaterial, ...]) -> bytes:
    """Several sessions' material as one stored answer: a msgpack list of each one's bytes."""
    return msgpack.packb([one.to_bytes() for one in materials], use_bin_type=True)


def unpack_materials(data: bytes, sessions: int) -> tuple[AuditMaterial, ...]:
    """The material ``pack_materials`` stored (or one ``AuditMaterial``'s bytes, for one session)."""
    if sessions == 1:
        return (AuditMaterial.from_bytes(data),)
    packed = msgpack.unpackb(data, raw=False)
    if not isinstance(packed, list) or len(packed) != sessions:
        raise ValueError(f"a memory challenge's answer holds {sessions} sessions' material")
    return tuple(AuditMaterial.from_bytes(one) for one in packed)
