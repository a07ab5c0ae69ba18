"""`import weightfabric as wf`: the public API, and what importing it does not load."""

from __future__ import annotations

import inspect
import subprocess
import sys

import weightfabric as wf
from weightfabric.fabric import errors


def test_every_error_type_is_in_the_public_api():
    kinds = {n for n, c in vars(errors).items()
             if inspect.isclass(c) and issubclass(c, Exception) and c.__module__ == errors.__name__}
    assert kinds <= set(wf.__all__)
    assert all(getattr(wf, n) is getattr(errors, n) for n in kinds)


def test_every_public_name_resolves():
    assert all(hasattr(wf, name) for name in wf.__all__)
    assert wf.serve is wf.fabric.hub.serve


def test_importing_it_loads_neither_the_hub_nor_plotting_nor_rich():
    code = ("import sys, weightfabric as wf; wf.join; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'rich', 'PIL')"
            " or m.split('.')[:3] == ['weightfabric', 'fabric', 'hub']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]", out
