"""Logging in the cluster's processes: the ingress and every replica log like `stillcut serve`.

Ray starts those processes itself, so each sets up the `stillcut` loggers (the access log
included) on its own stderr, which Ray forwards to the driver's terminal with the process's
name in front.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def configure_logging(level: str) -> None:
    """Send the `stillcut` loggers at `level` and above to stderr (once per process)."""
    logger = logging.getLogger("stillcut")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
