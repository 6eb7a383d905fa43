"""The progress bar of the evaluation commands (`dicache sweep`, `dicache calibrate`), kept whole while the libraries
they drive log: every logger that writes to the console (the root's and the libraries' own, such as cache-dit's
"Acceleration hooks is disabled …" warning) writes through tqdm while the bar is open (tqdm's logging redirect)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def console_loggers() -> list[logging.Logger]:
    """The root logger and every existing logger with a handler writing to stdout or stderr."""
    loggers = [logging.root]
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and any(_to_console(h) for h in logger.handlers):
            loggers.append(logger)
    return loggers


def _to_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)


@contextmanager
def progress_bar(**kwargs: Any) -> Iterator[Any]:
    """A tqdm bar (`kwargs` as tqdm's), closed on exit; console log lines go above it meanwhile."""
    bar = tqdm(**kwargs)
    try:
        with logging_redirect_tqdm(loggers=console_loggers(), tqdm_class=tqdm):
            yield bar
    finally:
        bar.close()
