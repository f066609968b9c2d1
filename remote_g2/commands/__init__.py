"""Core ``remote-g2`` subcommands (each module: ``add_arguments`` + ``run``)."""
