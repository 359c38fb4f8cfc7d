"""The trace-driven discrete-event simulator (:mod:`.simulator`: the runtime's own per-layer loop on a simulated clock),
the simulated platforms (:mod:`.platforms`: Snapdragon 8 Elite) and its runs and validation against measured runs
(:mod:`.simrun`).

Imports :mod:`specprefetch.runtime.core` and :mod:`specprefetch.runtime.measurement` (``tests/test_architecture.py``).
"""
