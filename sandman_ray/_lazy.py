"""Package exports imported on first use.

A package's ``__init__`` that imported its exports at once would make every import of
one of its modules pay for all of them: ``python -m sandman_ray.providers.janitor``, a
process of its own that must not load Ray, would load Ray through ``sandman_ray``'s
exports. ``exports`` gives a package the module ``__getattr__`` and ``__dir__``
(PEP 562) that import a name from its module when it is first asked for."""

import importlib
import sys
from typing import Callable, Dict, Iterable, List, Tuple


def exports(package: str, where: Dict[str, Iterable[str]]) -> Tuple[Callable, Callable]:
    """``where`` maps a module (absolute, or relative to ``package``) to the names it
    exports; returns the package's ``__getattr__`` and ``__dir__``."""
    module_of = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError("module %r has no attribute %r" % (package, name))
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # the next lookup is a plain one
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(module_of))

    return __getattr__, __dir__
