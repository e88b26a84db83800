"""Old module paths kept importable (with a DeprecationWarning) after the tooling moved into subpackages."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module -> where it lives now
MOVED = {
    "hf_blockpilot.bench": "hf_blockpilot.tools.bench",
    "hf_blockpilot.cards": "hf_blockpilot.tools.cards",
    "hf_blockpilot.datasets": "hf_blockpilot.data",
    "hf_blockpilot.defaults": "hf_blockpilot.tools.loading",
    "hf_blockpilot.demo": "hf_blockpilot.tools.demo",
    "hf_blockpilot.environment": "hf_blockpilot.tools.env_report",
    "hf_blockpilot.evaluation": "hf_blockpilot.tools.evaluation",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name and hands out the module at its new place."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new place is already executed."""


def install() -> None:
    """Register the old paths (idempotent)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
