"""One logging format for every command, gated to rank 0 under torchrun/accelerate."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from .launcher import launcher_env

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def process_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched distributed)."""
    return launcher_env().rank


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (test capture swaps it), through ``tqdm.write``: a
    progress bar that is being drawn is cleared first and redrawn below the line, never cut by it."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; always follow sys.stderr
        pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging(level: int | str = logging.INFO, all_ranks: bool = False) -> None:
    """Configure the root logger once. Non-zero ranks log warnings and errors only."""
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    rank = process_rank()
    if rank != 0 and not all_ranks:
        level = logging.WARNING
    fmt = FORMAT if rank == 0 else f"[rank {rank}] {FORMAT}"
    root = logging.getLogger()
    root.handlers.clear()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("urllib3", "fsspec", "asyncio", "numcodecs", "zarr", "matplotlib", "PIL", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # huggingface_hub prints through a handler of its own: propagating too would print every message twice
    logging.getLogger("huggingface_hub").propagate = False
