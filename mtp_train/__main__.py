"""python -m mtp_train: the command line (cli.py)."""

from .cli import main

main()
