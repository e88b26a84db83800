"""Tooling around the core: model loading (the embedded default and its GGUF target), evaluation, the benchmark
and its baseline controllers, the demo, model cards and the environment report. The decoding core never imports
it."""
