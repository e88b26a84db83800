"""Package layout: the core imports no tooling; the public API is what users need."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_core_loads_no_tooling():
    code = (
        "import sys, hf_blockpilot; "
        "print(sorted(m for m in sys.modules if m.startswith(('hf_blockpilot.tools', 'hf_blockpilot.training', "
        "'hf_blockpilot.cli', 'hf_blockpilot.data'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_public_api_is_what_users_need():
    import hf_blockpilot
    from hf_blockpilot import controllers

    exported = set(hf_blockpilot.__all__)
    assert {
        "BlockDiffusionDrafter",
        "BlockDiffusionConfig",
        "DraftController",
        "AdaptiveVerify",
        "SpeculationGuard",
        "BlockPilotPolicy",
        "CostModel",
        "SpeculationStats",
    } <= exported
    assert len(exported) <= 18  # building blocks live in their modules (hf_blockpilot.controllers, .policy, .stats)
    assert all(getattr(hf_blockpilot, name) is not None for name in exported)
    assert "DraftedRound" not in exported and controllers.DraftedRound is not None  # a building block, in its module
