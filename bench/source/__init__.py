"""Source benchmarks: resolve + release round trips, the progress modes (``progress_procs/``: its source and
reader processes), and the soak of target clients against an evicting source."""
