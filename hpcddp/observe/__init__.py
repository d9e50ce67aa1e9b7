"""Seeing what a job does: ``timeline`` records forward, backward, step and every bucket's
reduction as a Chrome trace (``hpcddp.init(timeline=...)`` or ``HPCDDP_TIMELINE``)."""
