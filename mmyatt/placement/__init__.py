"""Placement: which role (rollout, judge, train) holds which cores at each phase.

``shared`` (nothing pinned), ``colocate`` (full coexistence: phases in series, each on
every core, the judge's weights dropped between its phases), ``partial`` (rollout and
judge at once on split cores, groups streamed to the judge as they finish, training on
every core) and ``auto`` (measures phase costs, predicts each mode's step time, picks).
See docs/placement.md and BENCHMARKS.md "Placement".
"""
