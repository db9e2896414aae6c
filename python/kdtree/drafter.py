"""``kdtree.drafter`` is :mod:`kdtree.engine.drafter`: this name stays importable and is the same module."""

import sys

from .engine import drafter as _module

sys.modules[__name__] = _module
