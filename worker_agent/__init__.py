"""The swarm worker agent and the per-job coordinator.

This package runs on a GPU owner's machine with ``pip install '.[worker]'`` alone: it never
imports Django or the control plane.
"""

__version__ = "0.1.0"
