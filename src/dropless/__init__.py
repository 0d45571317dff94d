"""dropless: Mixture-of-Experts training in JAX that never drops or pads a token."""

__version__ = "0.1.0"
