"""Measurements behind past design questions: the resolve's transport floor, a woken hop, a NIXL descriptor, a
first touch."""
