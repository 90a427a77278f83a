"""The command line, a thin shell over the Python API: ``countdown <command>`` (``commands.py``)."""

from .commands import main

__all__ = ["main"]
