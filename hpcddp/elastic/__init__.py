"""Elastic jobs, a rank's side: its link to the driver and the commits kept on its node.

``session`` (with ``worker``, ``commits`` and ``protocol``) is what ``hvd.elastic`` uses in
a rank; the driver that ``hpcddp run --min-np`` runs is ``hpcddp.cli.elastic``.
"""
