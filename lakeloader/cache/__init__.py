"""Decoded units of one rank: decoded once, packed into a shared arena, evicted once used.

``decode`` turns a unit into its cached form (``packed`` rows and ``views`` of strings in the
``arena``, other columns as Arrow), ``screening`` leaves quarantined units out of a step,
``kernels`` keeps Arrow's take away from slices it gets wrong, and
``store`` decodes ahead of use in plan order within the byte budget.
"""
