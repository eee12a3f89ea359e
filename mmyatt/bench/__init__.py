"""Benchmarks: measured figures and the ratios that matter, one registered bench a figure.

``registry`` names every bench once; ``runs`` holds what they share. These machines are
noisy, so every benchmark runs its variants side by side in one invocation and reports
ratios next to the raw figures.
"""
