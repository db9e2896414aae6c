"""``kdtree.hf`` is :mod:`kdtree.engine.hf`: this name stays importable and is the same module."""

import sys

from .engine import hf as _module

sys.modules[__name__] = _module
