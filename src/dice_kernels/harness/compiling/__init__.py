"""Compiling a candidate's extensions: the content-addressed build cache (cache.py, parent side), the build step
inside the sandboxed worker (in_sandbox.py), and the build speed-ups that never change what code means (speed.py,
light_headers.py)."""
