"""The protocol and trust library: what goes over the wire and what proves who did what.

A stage's model and layer span (``span``), wire frames (``wire``), the stage connection's rules
(``connection``), the control channel's messages (``control_protocol``), job tickets and peer
passes (``tickets``), node keys (``keys``), the swarm's TLS (``tls``), signed links between stages
(``links``), receipts and their coverage (``receipts``, ``coverage``), seeded challenges and live
audits (``challenge``, ``audit``), the relay's messages and passes (``relay_protocol``,
``relay_pass``) and how a connection's frames reach its socket (``transport``). The control plane
imports this room; it imports nothing from the agent's runtime, the coordinator or the dev tools.
"""
