"""Progress bars for bench runs (tqdm): on stderr and only on a terminal, so that a run's
table and JSON line on stdout, and its logs in CI, stay as they are. Without tqdm (an
install without the bench extra) a run shows no bar and runs the same."""

import sys
from typing import Iterable, Optional, TypeVar

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the install
    tqdm = None

T = TypeVar("T")


class _NoBar:
    """What a run uses of a bar, doing nothing but ``write``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stdout)


def bar(total: int, desc: str, unit: str = "round"):
    """A bar to ``update()`` by hand (a ``with`` block closes it)."""
    if tqdm is None:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None,
                leave=False, dynamic_ncols=True)


def steps(items: Iterable[T], desc: str, unit: str = "round",
          total: Optional[int] = None) -> Iterable[T]:
    """``items``, advancing a bar as each is taken."""
    if tqdm is None:
        return items
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, disable=None,
                leave=False, dynamic_ncols=True)
