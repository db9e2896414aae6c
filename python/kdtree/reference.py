"""``kdtree.reference`` is :mod:`kdtree.core.reference`: this name stays importable and is the same module."""

import sys

from .core import reference as _module

sys.modules[__name__] = _module
