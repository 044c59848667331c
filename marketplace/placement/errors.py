"""The placement package's one exception.

``PlacementError`` is raised for an input that cannot be placed (not enough memory for the
model, no chain of stages covering every layer) and for a malformed input (a non-positive
compute, a duplicate node id); placement never returns a partial answer instead.
"""

from marketplace.errors import DomainError


class PlacementError(DomainError):
    """The nodes, layers or measurements given cannot be turned into a valid placement."""

    code = "placement_failed"


class InvalidDataUrl(PlacementError):
    """An agent reported its block served at a URL the control plane will not route to."""

    code = "invalid_data_url"
