"""Benchmarks of remote-g2: tooling run from a source checkout, not part of the installed package.

Run each as a module from the repository root, ``python -m bench.<group>.<bench> [--json F]`` (``make bench``
and its siblings run them all). One sub-package per concern; ``bench.common`` holds what they share (the result
envelope, percentiles, CPU time, processes and servers). A bench may import ``remote_g2``, ``bench.common``, its
own group and the test suite's helpers (``tests.*``); nothing in the product imports ``bench``.
"""
