"""Publishing a run's files to object storage (or another folder) on a cadence: `moelab train --publish URL`.

    publisher = Publisher(out, "s3://bucket/runs/x", every_s=3600)
    publisher.check()                                   # DataError now if the URL is unreachable or refused
    train(cfg, out, sinks=[publisher])                  # a Sink: publishes on the cadence, and once at the end

What it copies: the run directory's mixture log, metrics, incidents, config, resumes, data provenance and
summary (`PUBLISHED`), plus any `extra` files (a lab run's ledger export and report). Each copy is one
complete object (`moelab.data.remote.publish`), so a reader of the bucket sees the previous version of a
file or the new one, never half of it. The first record publishes at once, then at most every `every_s`
seconds, and closing publishes everything a last time. A failed upload mid-run warns and is retried at the
next turn: training never stops for the bucket.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from moelab.data import remote
from moelab.errors import DataError
from moelab.parallel import mesh as mesh_lib
from moelab.train.outputs import CONFIG, DATA, INCIDENTS, METRICS, MIXTURE_LOG, RESUMES, SUMMARY

__all__ = ["PUBLISHED", "DEFAULT_EVERY_S", "PublishWarning", "Publisher"]

PUBLISHED = (MIXTURE_LOG, METRICS, INCIDENTS, CONFIG, RESUMES, DATA, SUMMARY)
DEFAULT_EVERY_S = 3600.0  # hourly, as the run moelab is modelled on published its data composition


class PublishWarning(UserWarning):
    """An upload failed; the files are published again at the next turn."""


class Publisher:
    """A `moelab.train.outputs.Sink` that copies the run's files to `destination` every `every_s` seconds."""

    def __init__(self, out: str | Path, destination: str, every_s: float = DEFAULT_EVERY_S,
                 extra: Sequence[Path] = (), before: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not every_s >= 0:
            raise DataError(f"--publish-every={every_s} is invalid: must be a number of seconds >= 0 (default "
                            f"{DEFAULT_EVERY_S:.0f}, hourly; 0 publishes at every record).")
        self.out, self.destination, self.every_s, self.extra, self._clock = Path(out), destination, every_s, extra, clock
        self._before = before  # e.g. refresh a ledger export among `extra`
        self._last: float | None = None
        self.uploads = 0

    def check(self) -> None:
        """Reach the destination once before training: DataError naming it if it is unreachable or refused."""
        if not remote.is_url(self.destination):
            Path(self.destination).mkdir(parents=True, exist_ok=True)
            return
        remote.check_writable(self.destination)

    def publish(self) -> None:
        """Copy every published file that exists now."""
        if self._before is not None:
            self._before()
        files = [self.out / name for name in PUBLISHED] + list(self.extra)
        for path in files:
            if path.is_file():
                remote.publish(path, remote.join(self.destination, path.name))
                self.uploads += 1
        self._last = self._clock()

    def _maybe(self) -> None:
        if self._last is not None and self._clock() - self._last < self.every_s:
            return
        try:
            self.publish()
        except DataError as e:
            self._last = self._clock()  # retried at the next turn, not at every record
            warnings.warn(f"publishing to {self.destination} failed; retrying in {self.every_s:.0f} s: {e}",
                          PublishWarning, stacklevel=2)

    def log(self, record: dict) -> None:
        self._maybe()

    def incident(self, incident: dict) -> None:
        self._maybe()

    def mixture(self, entry: dict) -> None:
        self._maybe()

    def samples(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        if mesh_lib.is_writer():  # `train` closes sinks on every process; one publishes
            self._last = None
            self._maybe()
