"""The agent's runtime: the ``swarm-worker`` command and what runs behind it.

Joining a control plane (``joining``, ``control``), fetching a catalog model's files (``fetch``),
measuring links to peers (``probes``), being served through a relay (``relay_client``,
``relayed``) and the relay process itself (``relay``, ``swarm-relay``). The stages it serves are
the layer runtime's (``worker_agent.stage``, ``worker_agent.server``), built from ``parts``: the
product's, or a test tool's. Nothing in the control plane imports this room.
"""
