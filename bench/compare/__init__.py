"""Two commits compared on this machine, in interleaved rounds: ``python -m bench.compare BASE``.

``compare`` holds the bench table, the rounds, the summary and the CLI; ``sides`` builds and checks each side (a
worktree with its own venv, or this checkout). A side runs each bench by its own layout: as a module
(``python -m bench.<group>.<bench>``) where its tree has one, else as the script ``bench/<bench>.py`` of a commit
from before the benches were packages.
"""
