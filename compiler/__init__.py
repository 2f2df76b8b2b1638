"""Compiler: capture, lower, build, artifacts, and the dsv41 CLI."""
