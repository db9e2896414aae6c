"""``kdtree.ngram`` is :mod:`kdtree.engine.ngram`: this name stays importable and is the same module."""

import sys

from .engine import ngram as _module

sys.modules[__name__] = _module
