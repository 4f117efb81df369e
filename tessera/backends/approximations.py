"""Polynomial approximations the backends share, so that both compute the same function."""

#: erf(x) ~ 1 - (a1 t + a2 t^2 + a3 t^3 + a4 t^4 + a5 t^5) exp(-x^2), t = 1 / (1 + p |x|), for x >= 0
#: (odd in x): Abramowitz & Stegun 7.1.26, |error| < 1.5e-7. As (a1, a2, a3, a4, a5, p).
ERF_A_S_7_1_26 = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429, 0.3275911)
