"""The ``sparserl`` backend's options: :class:`~torch_sparserl.config.BackendOptions`, under
its former name ``Settings`` (``torch_sparserl.Settings``). Every setting of the library is
in :mod:`torch_sparserl.config`.
"""

from __future__ import annotations

from .config import BackendOptions, logger

Settings = BackendOptions

__all__ = ["Settings", "logger"]
