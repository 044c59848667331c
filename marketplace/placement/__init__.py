"""Placement: which agent hosts which layers, which chain serves a request, where the coordinator runs.

Pure functions over plain values (no ORM, no Django): ``allocation`` splits a model's layers over
nodes and chooses the number of pipelines, ``routing`` picks the fastest chain of stages for one
request, ``tour`` orders a ring of agents around a coordinator and picks the coordinator's region.
Every module raises :class:`~marketplace.placement.errors.PlacementError` on an input it cannot place.
"""
