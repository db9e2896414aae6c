"""``kdtree.kdtr`` is :mod:`kdtree.core.kdtr`: this name stays importable and is the same module."""

import sys

from .core import kdtr as _module

sys.modules[__name__] = _module
