"""Progress of long index builds, on stderr: a tqdm bar when tqdm is installed, else a plain line.

``progress_bar(total, desc, unit)`` returns an object with ``update(n)`` and ``close()``. Without tqdm
(or with ``plain=True``) it prints ``<desc>: <done>/<total> <unit> (<pct>%)`` every twentieth of the
total (every ``every`` items when the total is unknown) and once at ``close``: counted in items, not
seconds, so the output is the same on a busy machine.
"""
from __future__ import annotations

import sys
from typing import TextIO


class PlainProgress:
    """Periodic one-line progress for terminals and logs without tqdm."""

    def __init__(self, total: int | None, desc: str, unit: str = "doc", *, initial: int = 0, every: int | None = None,
                 file: TextIO | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = initial
        self.every = every or (max(1, total // 20) if total else 10_000)
        self._next = self.n + self.every
        self.file = file
        self._closed = False

    def _print(self) -> None:
        out = self.file or sys.stderr
        pct = f" ({100.0 * self.n / self.total:.0f}%)" if self.total else ""
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}{pct}", file=out, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self._next:
            self._print()
            while self._next <= self.n:
                self._next += self.every

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._print()


class _Disabled:
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, unit: str = "doc", *, initial: int = 0, enabled: bool = True,
                 plain: bool = False):
    """A tqdm bar on stderr (``plain=False`` and tqdm importable), else :class:`PlainProgress`."""
    if not enabled:
        return _Disabled()
    if not plain:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, mininterval=0.5)
    return PlainProgress(total, desc, unit, initial=initial)
