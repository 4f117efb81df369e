"""One module per step down the IR levels."""


class TargetLoweringError(ValueError):
    """A tile module that the chosen platform cannot run as written (Tile IR -> Target IR)."""
