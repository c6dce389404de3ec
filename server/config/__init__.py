"""Server settings: one frozen ``Settings`` from CLI flags and ``CHATTTS_*`` variables.

:mod:`~server.config.settings` declares every flag (the ``Settings`` fields and the constants
beside them); :mod:`~server.config.reader`, the only reader of the environment, parses them.
"""

from server.config.reader import add_settings_arguments, load_settings, settings_from_namespace
from server.config.settings import (
    DEFAULT_OMP_SPIN_COUNT,
    ENV_PREFIX,
    OPENMP_VARIABLES,
    PROFILE_CHOICES,
    VERSION,
    Settings,
)

__all__ = [
    "DEFAULT_OMP_SPIN_COUNT",
    "ENV_PREFIX",
    "OPENMP_VARIABLES",
    "PROFILE_CHOICES",
    "VERSION",
    "Settings",
    "add_settings_arguments",
    "load_settings",
    "settings_from_namespace",
]
