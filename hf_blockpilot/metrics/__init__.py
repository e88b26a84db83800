"""The package's own `evaluate` metrics, loaded by path (no Hub access needed)."""

from pathlib import Path

AVAILABLE = ("speculative_decoding",)


def load(name: str = "speculative_decoding", **kwargs):
    """`evaluate.load` of one of this package's metric modules (`AVAILABLE`)."""
    import evaluate

    if name not in AVAILABLE:
        raise ValueError(f"unknown metric {name!r}; available: {', '.join(AVAILABLE)}")
    return evaluate.load(str(Path(__file__).parent / name / f"{name}.py"), **kwargs)
