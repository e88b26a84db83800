"""Tooling around the core: model loading (the embedded default and its GGUF target), evaluation and the
benchmark, the demo, model cards and the environment report. The core never imports it."""
