"""Code generators, one package per target family."""
