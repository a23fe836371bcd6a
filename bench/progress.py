"""Progress bars for bench runs (tqdm): on stderr and only on a terminal, so that a run's
table and JSON line on stdout, and its logs in CI, stay as they are."""

import sys
from typing import Iterable, Optional, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(total: int, desc: str, unit: str = "round") -> tqdm:
    """A bar to ``update()`` by hand (a ``with`` block closes it)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None,
                leave=False, dynamic_ncols=True)


def steps(items: Iterable[T], desc: str, unit: str = "round",
          total: Optional[int] = None) -> Iterable[T]:
    """``items``, advancing a bar as each is taken."""
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, disable=None,
                leave=False, dynamic_ncols=True)
