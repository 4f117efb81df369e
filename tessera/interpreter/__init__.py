"""Executors on the CPU: the Graph IR reference (the oracle) and the Tile IR interpreter."""
