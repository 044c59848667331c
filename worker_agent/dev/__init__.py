"""Tools for tests, benchmarks and demos: never imported by the product.

Cheating stages (``cheat``), WAN emulation (``wan``), local swarms of agent processes (``local``),
the data-plane demo (``demo``) and what a node observes of a job (``observed``). The entry points
``python -m worker_agent.dev.agent`` and ``python -m worker_agent.dev.coordinator`` run the product's
commands with these substituted in (``--cheat``, ``--wan``). An import contract (.importlinter)
keeps every other module of ``worker_agent`` and ``marketplace`` from reaching them.
"""
