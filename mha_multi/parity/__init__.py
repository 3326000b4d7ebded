"""The cross-backend parity harness.

``cases`` builds seeded cases and their float64 reference, ``runners`` drives
each backend from numpy, ``compare`` checks results against the tolerances
(docs: "Architecture"), and ``python -m mha_multi.parity`` ties them together.
"""
