"""Elastic jobs: lose a node and go on, grow back when hosts return.

``driver`` (with ``hosts``, ``launchers``, ``monitor``) is ``hpcddp run --min-np``'s side;
``session`` (with ``worker`` and ``commits``) is a rank's side. The user's API is
Horovod's, in ``hpcddp.horovod.elastic``.
"""
