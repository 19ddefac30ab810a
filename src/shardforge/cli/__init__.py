"""Command-line interface: one module per command; `main` only registers them."""
