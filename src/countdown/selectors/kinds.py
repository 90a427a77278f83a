"""The registry lines: importing a kind's module registers it (see :mod:`countdown.selectors.base`).

Adding a kind is one new file in this package and one name in the import below.
"""

from . import hybrid, lowrank, mixed, shadow, teal, ternary, threshold  # noqa: F401
from .base import KINDS

__all__ = ["KINDS"]
