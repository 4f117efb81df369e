"""One module per step down the IR levels."""
