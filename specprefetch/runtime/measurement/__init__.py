"""Measuring the runtime on this machine: greedy decoding with token timestamps (:mod:`.decode`), the benchmark harness
(:mod:`.session`), the window profile (:mod:`.window`: W_l, transfer time, the window rule's M_max, Figure 1), paired
interleaved benchmarks (:mod:`.bench` -> the runs CSV) and external device logs (:mod:`.external`).

Imports :mod:`specprefetch.runtime.core`, never the simulation (``tests/test_architecture.py``).
"""
