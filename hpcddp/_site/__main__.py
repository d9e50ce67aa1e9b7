"""``python -m hpcddp._site`` prints the folder to put on PYTHONPATH under a plain mpirun."""

from . import SITE_DIR

print(SITE_DIR)
