"""Package layout: the core imports no tooling, and the old module paths still import (with a warning)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hf_blockpilot._moved import MOVED


def test_importing_the_core_loads_no_tooling():
    code = (
        "import sys, hf_blockpilot; "
        "print(sorted(m for m in sys.modules if m.startswith(('hf_blockpilot.tools', 'hf_blockpilot.training', "
        "'hf_blockpilot.cli', 'hf_blockpilot.data'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_import_with_a_deprecation_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_names_resolve_to_the_moved_objects():
    from hf_blockpilot.data import load_prompts
    from hf_blockpilot.tools.loading import resolve_drafter

    with pytest.warns(DeprecationWarning):
        sys.modules.pop("hf_blockpilot.datasets", None)
        from hf_blockpilot.datasets import load_prompts as old_load_prompts
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("hf_blockpilot.defaults", None)
        from hf_blockpilot.defaults import resolve_drafter as old_resolve_drafter
    assert old_load_prompts is load_prompts and old_resolve_drafter is resolve_drafter
