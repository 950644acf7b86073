"""gdn_packed microbenchmark CLI: `python -m bench --help` (see bench/NOTES.md).

Layout: registry.py (named scenarios and suites), model.py (FLOP/byte model, GPU ceilings),
gdr.py / kernels.py / layers.py (per op family: inputs, provider calls, cases, correctness gates),
providers.py (every provider declared once), timing.py,
runner.py (the sweep), output.py (tidy rows, files, tables), plot.py, cli.py.
"""
