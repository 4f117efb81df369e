"""Performance tooling: `tessera bench` (Tessera against its peers, with statistics, baselines and
regression checks) and the arithmetic behind `tessera profile`'s roofline report.

Only `cases` (building inputs), `timing` (the timing calls) and `triton_mma_sync` touch torch or
Triton, and they import them when a case runs: listing cases, comparing result files and rendering
reports work on any machine.
"""
