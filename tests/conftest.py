"""Test-wide settings.

TRITON_INTERPRET must be set before any module with a `@triton.jit` kernel is
imported: the decorator reads it. Kernel tests then run on the CPU interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
