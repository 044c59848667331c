"""A model's layer span: which decoder layers of which model a stage serves.

``Span(model, start, end)`` names the layers ``[start, end)`` of ``model``. It is the identity of
a stage wherever the agent, the coordinator and the control plane key, compare or load one (an
agent's stages on one port, what a connection is bound to, a ticket's target, a trusted block).
Records whose wire or column form carries the three as separate fields keep them (receipts,
tickets, control messages, database rows); those that code keys or compares by stage give a
``span`` property (tickets and peer passes, the control channel's ``Assign``, ``stage.Stage``, and
the control plane's ``Assignment``, ``Challenge`` and ``Audit``).

It is frozen, hashable (a dict key) and ordered by model, then start, then end. Construction
checks it: a span that is not a non-empty model name with integer bounds ``0 <= start < end``
raises ``ModelError`` (code ``bad_span``). Whether it fits inside the model's layer count is the
model registry's question (``model.check_span``).

It prints as ``smollm2-135m layers 0:10``, the form the agent's logs and errors use for a stage
(``swarm-worker serve --layers 0:10`` names the same layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_agent.errors import ModelError

BAD_SPAN = "bad_span"


def _is_int(value: object) -> bool:
    # bool is an int subclass; a span ending at True is malformed, not layer 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, order=True)
class Span:
    model: str  # the model's id (a registry name, a catalog ref or a checkpoint folder)
    start: int  # first decoder layer, inclusive, 0-based
    end: int  # end of the span, exclusive

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ModelError(f"a span's model must be a non-empty string, got {self.model!r}", code=BAD_SPAN)
        if not (_is_int(self.start) and _is_int(self.end) and 0 <= self.start < self.end):
            raise ModelError(
                f"bad layer span {self.start!r}:{self.end!r} for {self.model}: need integers 0 <= start < end",
                code=BAD_SPAN,
            )

    @property
    def layers(self) -> int:
        """How many decoder layers the span holds."""
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.model} layers {self.start}:{self.end}"
