"""G2 memory benchmarks: the pool index's find_and_pin, and what prefaulting a pool buys."""
