"""Names shared by the runtime, its config section and the external-log schema (no heavy imports: the
Snakefile reads them while building the DAG)."""

from __future__ import annotations

POLICIES = ("off", "pred0", "specprefetch", "naive", "fate", "resident")
PREDICTING = ("pred0", "specprefetch", "naive", "fate")
STORAGES = ("nvme_cold", "nvme", "ufs", "slow_ufs", "sdcard", "ram")
EMULATED = ("nvme", "ufs", "slow_ufs", "sdcard")
EXPERIMENTS = ("main", "matched", "sweep", "storage", "component")
PAPER_EXPERT_MB = 1.94
# Emulated storage: sustained read bandwidth (MB/s) and per-request latency (ms) of phone-class devices.
DEFAULT_PROFILES: dict[str, dict[str, float]] = {
    "nvme": {"bandwidth_mbps": 3500.0, "latency_ms": 0.08},
    "ufs": {"bandwidth_mbps": 1700.0, "latency_ms": 0.15},
    "slow_ufs": {"bandwidth_mbps": 750.0, "latency_ms": 0.30},
    "sdcard": {"bandwidth_mbps": 90.0, "latency_ms": 1.00},
}
