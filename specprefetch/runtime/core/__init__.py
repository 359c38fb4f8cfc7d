"""The offloaded-MoE runtime itself (paper §3.3): what a decode step needs, nothing that measures it.

- :mod:`.store`, :mod:`.quant`, :mod:`.paper_scale`: the expert store (one aligned record per expert), 4-bit records,
  experts widened to the real models' shapes;
- :mod:`.storage`: storage profiles (cold physical disk, RAM, emulated NVMe/UFS/slow UFS/SD card), the reader;
- :mod:`.cache`, :mod:`.transfer`: the bounded expert cache and the prioritised background transfer engine;
- :mod:`.priority`, :mod:`.budget`: next-layer priorities (trained predictors, FATE, Naive Prefetch) and M_max, decided
  once;
- :mod:`.iobackend`, :mod:`.layer`, :mod:`.engine`: the I/O backend protocol, the one per-layer loop, the runtime that
  hooks it into the model;
- :mod:`.timeline`: per-layer events, counters, ReadyRecall; :mod:`.settings`: the ``device`` config section.

Imports only itself and the layers below the runtime (``tests/test_architecture.py``).
"""
