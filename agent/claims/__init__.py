"""Which tasks this node claims, and when.

Fit, locality, pool preference, and claims whose transaction's answer was lost.
"""
