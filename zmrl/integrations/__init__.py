"""Bridges from zmrl to other RL frameworks (each optional, imported only by its entry point)."""
