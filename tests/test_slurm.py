"""The SLURM profile (profiles/slurm) against a real one-node SLURM cluster started by this test.

A private munged, slurmctld and slurmd run from a temporary directory (own key, socket, ports, state, spool and
logs; clients find them through SLURM_CONF), so nothing of the machine's own SLURM or munge setup is used or
touched. Snakemake then runs, with ``--workflow-profile profiles/slurm``, two GPU-free rules of the smoke profile
(prepare_corpus -> train_tokenizer) through ``sbatch`` and the snakemake-executor-plugin-slurm, next to local rules
(prepare_workload, check_disjoint) on the submitting host, and reruns one rule with ``--forcerun``. Every daemon is
stopped by the PID this test got when it started it.

Needs root and the Debian packages ``slurmctld slurmd slurm-client munge`` (``.ci/run`` installs them where it can);
skips with the reason otherwise. ``python -m pytest -q tests/test_slurm.py`` runs it alone (about 1.5 minutes).
A fast test checks the profile's resources on a dry run of the paper profile (no SLURM needed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specprefetch.workflow import Pipeline

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# Debian puts the daemons in /usr/sbin, which a non-login root shell may not have on PATH.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sacct", "sinfo", "scontrol", "scancel")
STARTUP_TIMEOUT = 60  # seconds until the node must be idle
SNAKEMAKE_TIMEOUT = 300  # per Snakemake call; each of the two runs takes ~20-40 s here


def _which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_hardware() -> dict[str, str]:
    """``slurmd -C``: the node line SLURM itself derives from this machine (CPUs, sockets, cores, RealMemory)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("NodeName="))
    hw = dict(kv.split("=", 1) for kv in line.split())
    hw.pop("NodeName")
    return hw


def _profile_partitions() -> set[str]:
    """The partitions profiles/slurm/config.yaml sends jobs to (default-resources and set-resources)."""
    import yaml

    prof = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    parts = {v.split("=", 1)[1] for v in prof["default-resources"] if v.startswith("slurm_partition=")}
    parts |= {r["slurm_partition"] for r in prof.get("set-resources", {}).values() if "slurm_partition" in r}
    return parts


@dataclass
class LocalSlurm:
    root: Path
    conf: Path
    env: dict[str, str]
    node: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    outputs: list = field(default_factory=list)

    def run(self, *cmd: str, timeout: int = 30) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]) or cmd[0], *cmd[1:]], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"==> {f.name} <==\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(parts)

    def start(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "w")  # noqa: SIM115 -- closed in stop()
        self.outputs.append(out)
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)

    def stop(self) -> None:
        """Cancel what is left of the jobs, then stop each daemon this test started, by its PID, newest first."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--user", str(os.getuid()), timeout=15)  # only this private cluster's jobs
                time.sleep(1)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for out in self.outputs:
            out.close()


def _write_conf(root: Path, node: str, hw: dict[str, str], partitions: set[str]) -> Path:
    for d in ("state", "spool", "log", "run", "munge"):
        (root / d).mkdir(mode=0o755 if d == "munge" else 0o700, parents=True, exist_ok=True)
    node_line = " ".join(f"{k}={v}" for k, v in hw.items() if k != "UpTime")
    lines = [
        "ClusterName=specprefetch-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "ReturnToService=2",
        # Finished jobs stay visible to squeue for MinJobAge seconds. The plugin only honours
        # slurm-status-command=squeue while MinJobAge >= 3 x slurm-init-seconds-before-status-checks.
        "MinJobAge=300",
        "KillWait=5",
        f"NodeName={node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 {node_line} State=UNKNOWN",
    ]
    # The partitions the profile names (cpu, gpu), all on the one node; the first one the profile's default.
    for name in sorted(partitions, key=lambda p: p != "cpu"):
        default = "YES" if name == "cpu" else "NO"
        lines.append(f"PartitionName={name} Nodes={node} Default={default} MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the private slurmctld/slurmd/munged run as root (SlurmUser=root)")
    missing = [n for n in NEEDED if _which(n) is None]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing): "
                    "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge")

    root = Path(tmp_path_factory.mktemp("slurm"))  # kept by pytest after the run: slurm.conf and the daemons' logs
    node = "spnode1"
    conf = _write_conf(root, node, _node_hardware(), _profile_partitions())
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    # Inside each job the plugin runs the rule with `srun` (snakemake-executor-plugin-slurm-jobstep), after
    # deleting every SLURM_* variable but the job's ids from srun's environment -- SLURM_CONF included. On a real
    # cluster srun then reads /etc/slurm/slurm.conf (or slurmd's configless cache); this private cluster has no
    # config there (and the test writes nothing outside its temp dir), so a two-line `srun` first on PATH (which
    # sbatch --export=ALL passes into the job) puts SLURM_CONF back and execs the real srun, nothing else.
    bindir = root / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {_which("srun")} "$@"\n')
    (bindir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_"))}
    env.update(SLURM_CONF=str(conf),
               PATH=os.pathsep.join([str(bindir), str(Path(sys.executable).parent), SEARCH_PATH]))
    cluster = LocalSlurm(root=root, conf=conf, env=env, node=node)
    try:
        # All of munged's files in the temp dir. --force: munged refuses to start when a directory above its key,
        # socket or logs is writable by others (it depends on where the temp dir is); with --force it only warns.
        cluster.start("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                                 f"--socket={root}/munge/munge.socket", f"--pid-file={root}/run/munged.pid",
                                 f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed"])
        deadline = time.monotonic() + 20
        while not (root / "munge" / "munge.socket").exists():
            if cluster.procs["munged"].poll() is not None or time.monotonic() > deadline:
                pytest.fail("munged did not start:\n" + cluster.logs())
            time.sleep(0.2)
        cluster.start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(conf)])
        cluster.start("slurmd", [_which("slurmd"), "-D", "-f", str(conf), "-N", node])
        deadline = time.monotonic() + STARTUP_TIMEOUT
        state = ""
        while time.monotonic() < deadline:
            for name, proc in cluster.procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}:\n{cluster.logs()}")
            res = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t")
            state = res.stdout.strip()
            if res.returncode == 0 and re.search(rf"^{node} idle$", state, re.M):
                break
            time.sleep(1)
        else:
            pytest.fail(f"node not idle after {STARTUP_TIMEOUT} s (sinfo: {state!r}):\n{cluster.logs()}")
        yield cluster
    finally:
        cluster.stop()


def _snakemake(cluster: LocalSlurm, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """Snakemake with the SLURM profile on the smoke config. Targets go first in ``args``: options such as
    --forcerun take any number of values and would swallow a target placed after them."""
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args,
           "--configfile", str(ROOT / "config/smoke.yaml"), "--workflow-profile", str(ROOT / "profiles/slurm"),
           # The first status check after 5 s instead of 40 s (MinJobAge=300 >= 3 x 5, so the profile's
           # slurm-status-command=squeue stays in force). No --slurm-no-account: plugin 2.8.0 declares it but never
           # reads it; without slurmdbd it finds no account to guess and submits without -A anyway.
           "--slurm-init-seconds-before-status-checks", "5",
           # The plugin deletes the SLURM logs of successful jobs; they are part of the evidence checked below.
           "--slurm-keep-successful-logs",
           "--retries", "0"]  # the profile retries once; a failure must fail here, not be retried away
    # No --set-resources / --default-resources override: prepare_corpus and train_tokenizer ask for no GPU
    # (gpu=0, partition cpu) under this profile, so the GPU-less node runs them as the profile sends them.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=SNAKEMAKE_TIMEOUT, env=cluster.env)


def _job_counts(output: str) -> dict[str, int]:
    block = output.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", block, re.M)}


def _slurm_job_ids(output: str) -> dict[str, list[str]]:
    """Rule -> SLURM job ids, from the plugin's 'Job N has been submitted with SLURM jobid J (log: ...)' lines."""
    ids: dict[str, list[str]] = {}
    for m in re.finditer(r"SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/", output):
        ids.setdefault(m.group(2), []).append(m.group(1))
    return ids


def _job_resources(output: str) -> dict[str, dict[str, str]]:
    """Rule -> the resources Snakemake printed for its (last) job."""
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", output, re.M)
    return {rule: dict(kv.split("=", 1) for kv in res.split(", ")) for rule, res in jobs}


def _job_info(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    res = cluster.run("scontrol", "show", "job", "--oneliner", job_id)
    assert res.returncode == 0, res.stderr
    return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)


@pytest.mark.slow
def test_slurm_profile_runs_rules_through_sbatch(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    import yaml

    cluster, work = local_slurm, tmp_path / "work"
    work.mkdir()
    n_workloads = len(yaml.safe_load((ROOT / "config/smoke.yaml").read_text())["workloads"])

    t0 = time.monotonic()
    res = _snakemake(cluster, work, "results/tokenizer", "results/workloads/disjointness.json")
    first_s = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:] + "\n" + cluster.logs()
    assert _job_counts(out) == {"prepare_corpus": 1, "train_tokenizer": 1, "prepare_workload": n_workloads,
                                "check_disjoint": 1}, out[-4000:]

    # prepare_corpus and train_tokenizer went through sbatch into the private cluster: one SLURM job each, finished,
    # in the partition the profile gives them, run in the workdir, each with the plugin's SLURM log. The cheap rules
    # (localrules in the Snakefile) ran on this host: no SLURM job.
    ids = _slurm_job_ids(out)
    assert set(ids) == {"prepare_corpus", "train_tokenizer"} and all(len(v) == 1 for v in ids.values()), out[-4000:]
    assert "localrule prepare_workload:" in out and "localrule check_disjoint:" in out, out[-4000:]
    requested = _job_resources(out)
    for rule, (job_id,) in ids.items():
        info = _job_info(cluster, job_id)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
        assert info["Partition"] == "cpu" and info["NodeList"] == cluster.node, info
        # The rule's resources became the SLURM job's: mem_mb -> --mem, runtime (minutes) -> -t, threads -> CPUs.
        mem_mb, runtime = int(requested[rule]["mem_mb"]), int(requested[rule]["runtime"])
        assert info["MinMemoryNode"] == f"{mem_mb}M", info
        assert info["TimeLimit"] == f"{runtime // 60:02d}:{runtime % 60:02d}:00", info
        assert info["NumCPUs"] == "1", info
        assert Path(info["WorkDir"]).resolve() == work.resolve(), info
        log = work / ".snakemake" / "slurm_logs" / f"rule_{rule}" / f"{job_id}.log"
        assert log.exists(), sorted(str(p) for p in (work / ".snakemake" / "slurm_logs").rglob("*"))
        text = log.read_text()
        assert f"rule {rule}:" in text and "1 of 1 steps (100%) done" in text, text[-3000:]

    # Job states came from squeue (the profile's slurm-status-command): the plugin says when it falls back to
    # sacct, and sacct has nothing to say without slurmdbd.
    assert "Falling back to 'sacct'" not in out, out[-4000:]
    sacct = cluster.run("sacct", "-X", "--parsable2", "--noheader", "--format=JobIdRaw,State")
    assert sacct.returncode != 0 or not sacct.stdout.strip(), (sacct.stdout, sacct.stderr)

    # The outputs are right, and every rule wrote its log and benchmark.
    corpus = json.loads((work / "results/corpus/manifest.json").read_text())
    assert corpus["format"] == "specprefetch-workload/1" and corpus["n_samples"] > 0
    assert json.loads((work / "results/workloads/disjointness.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "results/tokenizer")
    for special in ("<image>", "<|im_start|>", "<|endoftext|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    for rule, name in (("prepare_corpus", "corpus"), ("train_tokenizer", "tokenizer"), ("check_disjoint", "check")):
        assert (work / "logs" / rule / f"{name}.log").stat().st_size > 0, rule
        assert (work / "benchmarks" / rule / f"{name}.tsv").exists(), rule
    corpus_mtime = (work / "results/corpus/manifest.json").stat().st_mtime_ns
    tokenizer_mtime = (work / "results/tokenizer").stat().st_mtime_ns

    # Rerun one rule: --forcerun train_tokenizer runs that job only, again through sbatch.
    t0 = time.monotonic()
    again = _snakemake(cluster, work, "results/tokenizer", "--forcerun", "train_tokenizer")
    rerun_s = time.monotonic() - t0
    out2 = again.stdout + again.stderr
    assert again.returncode == 0, out2[-6000:] + "\n" + cluster.logs()
    assert _job_counts(out2) == {"train_tokenizer": 1}, out2[-4000:]
    ids2 = _slurm_job_ids(out2)
    assert list(ids2) == ["train_tokenizer"] and len(ids2["train_tokenizer"]) == 1, out2[-4000:]
    (new_id,) = ids2["train_tokenizer"]
    assert int(new_id) > max(int(i) for v in ids.values() for i in v)
    assert _job_info(cluster, new_id)["JobState"] == "COMPLETED"
    assert (work / ".snakemake/slurm_logs/rule_train_tokenizer" / f"{new_id}.log").exists()
    assert (work / "results/tokenizer").stat().st_mtime_ns != tokenizer_mtime  # rewritten
    assert (work / "results/corpus/manifest.json").stat().st_mtime_ns == corpus_mtime  # upstream untouched

    # The controller knows every SLURM job of both runs as completed, and nothing is left to do.
    queue = cluster.run("squeue", "--states=all", "--noheader", "--format=%i %T")
    assert queue.returncode == 0, queue.stderr
    completed = {ln.split()[0] for ln in queue.stdout.splitlines() if ln.split()[1:] == ["COMPLETED"]}
    assert {i for v in ids.values() for i in v} | {new_id} <= completed, queue.stdout
    dry = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(work), "-n", "--cores", "1",
                          "results/tokenizer", "results/workloads/disjointness.json",
                          "--configfile", str(ROOT / "config/smoke.yaml")],
                         capture_output=True, text=True, timeout=120, env=cluster.env)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    print(f"\nSLURM: first run (2 sbatch jobs + {n_workloads + 1} local) {first_s:.1f} s, "
          f"forced rerun (1 sbatch job) {rerun_s:.1f} s")


# The rules that ask for a GPU under the paper profile (Pipeline's own table, so a new GPU rule cannot be left out of
# the profile), and pretrain_stand_in, which the profile sends to a GPU for the stand-in configs.
GPU_RULES = {rule for rule, kinds in Pipeline._RESOURCES.items() if kinds["paper"].get("gpu")} | {"pretrain_stand_in"}


def test_slurm_profile_resources_on_the_paper_dag(tmp_path: Path) -> None:
    """Fast, no SLURM needed: what the profile asks for, on a dry run of the paper profile's whole DAG."""
    import yaml

    prof = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    assert prof["executor"] == "slurm" and prof["slurm-status-command"] == "squeue"
    assert set(prof["set-resources"]) == GPU_RULES
    # A misspelt rule name in set-resources is silently ignored by Snakemake: every name must be a rule.
    rules = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--list-rules",
                            "--configfile", str(ROOT / "config/smoke.yaml")],
                           capture_output=True, text=True, timeout=120)
    assert rules.returncode == 0, rules.stderr[-3000:]
    assert GPU_RULES <= {ln.split()[0] for ln in rules.stdout.splitlines() if ln.strip()}

    res = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "-n",
                          "paper_tables", "--configfile", str(ROOT / "config/paper.yaml"),
                          "--workflow-profile", str(ROOT / "profiles/slurm")],
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, re.M)
    assert jobs, out[-3000:]
    for rule, resources in jobs:
        res_map = dict(kv.split("=", 1) for kv in resources.split(", "))
        if rule in GPU_RULES:
            want = {k: str(v) for k, v in prof["set-resources"][rule].items()}
            assert {k: res_map.get(k) for k in want} == want, (rule, resources)
        else:
            assert res_map["gpu"] == "0" and res_map["slurm_partition"] == "cpu", (rule, resources)
    assert GPU_RULES - {"pretrain_stand_in"} <= {r for r, _ in jobs}  # the paper profile has no stand-ins

    # A --set-resources on the command line replaces the profile's whole set-resources block (it does not merge):
    # the README's way to run a CPU-only config through the profile. Then no job asks for a GPU.
    cpu = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "-n",
                          "paper_tables", "--configfile", str(ROOT / "config/smoke.yaml"),
                          "--workflow-profile", str(ROOT / "profiles/slurm"),
                          "--set-resources", "extract_traces:gpu=0"],
                         capture_output=True, text=True, timeout=300)
    assert cpu.returncode == 0, (cpu.stdout + cpu.stderr)[-4000:]
    cpu_jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", cpu.stdout + cpu.stderr, re.M)
    assert GPU_RULES <= {r for r, _ in cpu_jobs}
    for rule, resources in cpu_jobs:
        assert "gpu=0" in resources.split(", ") and "slurm_partition=cpu" in resources.split(", "), (rule, resources)
