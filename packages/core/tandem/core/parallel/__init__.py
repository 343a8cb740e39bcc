"""Parallel layout: topology, which collectives each level uses, group construction."""
