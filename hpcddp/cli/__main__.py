"""python -m hpcddp.cli: the hpcddp command."""

from . import main

main(prog_name="hpcddp")
