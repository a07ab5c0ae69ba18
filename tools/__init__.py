"""Command-line tools: the `fabric` command (`tools.cli`), its benchmarks and the demo."""
