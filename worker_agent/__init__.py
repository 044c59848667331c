"""The swarm worker agent and the per-job coordinator.

This package runs on a GPU owner's machine with ``pip install '.[worker]'`` alone: it never
imports Django or the control plane. Its rooms, by role:

``protocol/``
    The protocol and trust library: wire frames, the stage connection's rules, the control
    channel's messages, tickets, keys, TLS, signed links, receipts and coverage, challenges and
    audits, the relay's messages and passes, and a connection's transport.
``agent/``
    The agent's runtime: ``swarm-worker`` (joining, the control channel, fetching a model's files,
    link probes, relayed serving) and the ``swarm-relay`` process.
``coordinator/``
    The per-job coordinator: the pipeline, sampling, speculation, healing, the challenger.
``dev/``
    Tools for tests, benchmarks and demos: cheating stages, WAN emulation, local swarms, the
    data-plane demo, and the entry points that run the product's commands with them substituted in.
The top level
    The model loader and the layer runtime: ``model``, ``architectures``, ``checkpoints``,
    ``block``, ``kvcache``, ``kernels``, ``devices``; ``stage`` and ``server``, which serve a
    block's span (the agent serves them, and so do the verifier's stand-ins in
    ``coordinator/challenger.py``); ``metrics``; and ``errors``, the package's one exception
    hierarchy.

Who may import what (import contracts in ``.importlinter``, checked by ``lint-imports``): the
control plane imports ``protocol``, ``coordinator`` and the top level, never ``agent`` or ``dev``;
nothing outside ``dev`` imports ``dev``; ``protocol`` imports nothing from ``agent``,
``coordinator`` or ``dev``; ``agent`` and ``coordinator`` do not import each other.
"""

__version__ = "0.1.0"
