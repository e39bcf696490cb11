"""Logging inside Ray worker processes, where nothing configures Python logging for our loggers.

Serve configures only its own `ray.serve` logger; a worker's root logger stays at WARNING, which would
drop the finish log. Each replica calls `configure_logging()` once: the `tensorfold` loggers write INFO
lines to stderr, which Ray forwards to the driver (`serve run`, `tensorfold serve`) and to its log files.
"""

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    logger = logging.getLogger("tensorfold")
    logger.setLevel(level)
    if not any(getattr(h, "_tensorfold", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._tensorfold = True  # type: ignore[attr-defined]  # marks ours, so a second call adds none
        logger.addHandler(handler)
    logger.propagate = False  # a driver-side root handler would print every line twice
