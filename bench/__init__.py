"""gdn_packed microbenchmark CLI: `python -m bench --help` (see bench/NOTES.md).

Layout: registry.py (named scenarios and suites), model.py (FLOP/byte model, GPU ceilings),
gdr.py / kernels.py / layers.py (inputs, providers and correctness gates per op), timing.py,
runner.py (the sweep), output.py (tidy rows, files, tables), plot.py, cli.py.
"""
