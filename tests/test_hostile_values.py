"""Hostile values and hostile paths (issue 30): files that parse and have the right keys but hold NaN, negative or
out-of-range numbers, ids that index nothing, names with control characters; paths that are FIFOs, symlink loops,
directories or too long; YAML alias bombs; a full disk while rendering. Every case through the CLI exits 2 with
one line naming the file and field, no traceback, nothing at the output path.

Then property-based tests per reader (hypothesis): generated hostile values each raise the reader's one-line
error naming the file and field, and valid values pass. CI size by default; ``HOSTILE_EXAMPLES=250`` runs them at
10x by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import (
    EXTERNAL_ROW,
    MODEL,
    Case,
    K,
    L,
    N,
    _collect,
    _config,
    _copy,
    _edit_json,
    _ext_file,
    _gather_params,
    _run,
    _set,
    _simulate,
    _validate,
    _validate_text,
    build_good,
)

from specprefetch.contracts import (
    ROUTING_FORMAT,
    WINDOW_SHAPE_KEYS,
    ContractError,
    check_finite_tensors,
    check_label,
    check_model_dims,
    check_pixel_budget,
    check_routing_values,
    check_window_profile,
    load_tensor_tree,
    parse_yaml,
    regular_file,
    save_tensor_tree,
)
from specprefetch.io import SpecPrefetchError

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "25"))
_PROP = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HOSTILE_NUMBERS = [float("nan"), float("inf"), -float("inf"), -1, -0.5, 0, 1e308, 2.5, "eight", None, True, [1], {}]


# --------------------------------------------------------------------------------------------- valid artefacts
@pytest.fixture(scope="session")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_good(tmp_path_factory.mktemp("good"))


def _profile() -> dict[str, Any]:
    """A window profile with every key validate-simulator reads (values of a tiny CPU run)."""
    part = {"head_s": 0.008, "book_s": [1e-4] * L, "pred_s": [0.0] * L, "post_pred_s": [0.0] * L,
            "moe_s": [1e-3] * L, "gap_s": [0.0] * L}
    return {"model": MODEL, "n_layers": L, "n_experts": N, "top_k": K, "payload_bytes": 4096, "io_workers": 2,
            "compute": {"loop": dict(part), "opt": dict(part), "pred": dict(part)},
            # under the delay emulation a storage's reads vary around the intended time: its overshoot may be < 0
            "transfer_ms": {"ram": {"transfer_ms": 0.01}, "nvme": {"transfer_ms": 1.1, "model_ms": 1.2,
                                                                 "overshoot_ms_mean": -0.1, "overshoot_ms_p95": 0.3,
                                                                 "source": "measured"}},
            "physical_model": {"bandwidth_mbps": 1000.0, "latency_ms": 0.1},
            "emulation_overshoot_ms": {"ufs": {"mean_ms": -0.2, "p95_ms": 0.5, "pct_of_model": float("nan")}},
            "window_ms_median_resident": float("nan"), "m_max_per_storage": {"nvme_cold": 4}}


def _window(tmp: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    w = tmp / "window"
    w.mkdir(exist_ok=True)
    prof = _profile()
    if edit:
        edit(prof)
    (w / "profile.json").write_text(json.dumps(prof))
    return w


def _routing(tmp: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    row = {"storage": "ram", "policy": "off", "m_max": 0, "capacity_experts": 4, "compute_opt": True,
           "tokens_per_s": 1.0, "ready_recall": 0.5, "hits": 1, "misses": 1, "prefetched": 0, "wasted": 0,
           "stall_ms": 0.0}
    g = torch.Generator().manual_seed(0)
    events = [{"step": 0, "layer": layer, "topk": torch.randint(0, N, (3, K), generator=g, dtype=torch.int16),
               "scores": None} for layer in range(L)]
    tree = {"model": MODEL, "platform": "local-cpu", "runs": {"main|off|ram|0|1": {
        "row": row, "events": events, "repeats": [dict(row)]}}}
    if edit:
        edit(tree)
    out = tmp / "r.safetensors"
    save_tensor_tree(out, tree, ROUTING_FORMAT)
    return out


def _events(tree: dict[str, Any]) -> list[dict[str, Any]]:
    return [ev for run in tree["runs"].values() for ev in run["events"]]


def _on_events(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda tree: [fn(ev) for ev in _events(tree)] and None


def _on_row(col: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda tree: [run["row"].update({col: value}) for run in tree["runs"].values()] and None


def _sim(routing_edit: Callable[[dict[str, Any]], None] | None = None,
         profile_edit: Callable[[dict[str, Any]], None] | None = None) -> Callable[..., tuple[list[str], Path]]:
    def make(good: dict[str, Path], tmp: Path) -> tuple[list[str], Path]:
        out = tmp / "val.csv"
        return ["validate-simulator", "--config", str(good["config"]), "--model", MODEL, "--window",
                str(_window(tmp, profile_edit)), "--routing", str(_routing(tmp, routing_edit)), "--out", str(out)], out

    return make


def _put(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        node = doc
        for k in head:
            node = node[k]
        node[last] = value

    return fn


def _nan_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _nan_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_floats(v) for v in obj]
    return float("nan") if isinstance(obj, float) else obj


def _all_nan(prof: dict[str, Any]) -> None:
    prof.update(_nan_floats(prof))


# traces: rewrite one shard (sha256 and size updated, so only the values are wrong)
def _rewrite_shard(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(t: Path) -> None:
        from safetensors.torch import load_file, save_file

        f = t / "shard-00000.safetensors"
        tensors = load_file(str(f))
        fn(tensors)
        save_file(tensors, str(f))
        data = f.read_bytes()
        _edit_json(t / "manifest.json", lambda m: m["shards"][0].update(bytes=len(data),
                                                                        sha256=hashlib.sha256(data).hexdigest()))

    return edit


def _verify(edit: Callable[[Path], None], command: str = "verify-traces") -> Callable[..., tuple[list[str], None]]:
    def make(good: dict[str, Path], tmp: Path) -> tuple[list[str], None]:
        t = _copy(good["trace"], tmp / "trace")
        edit(t)
        return [command, str(t)], None

    return make


def _empty_trace(t: Path) -> None:
    for f in t.glob("shard-*"):
        f.unlink()
    _edit_json(t / "manifest.json", lambda m: m.update(shards=[], n_tokens=0, n_samples=0))


def _symlink_loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


def _nan_weights(p: Path) -> None:
    from safetensors.torch import load_file, save_file

    w = p / "predictor.safetensors"
    state = load_file(str(w))
    first = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[first] = state[first].clone()
    state[first].view(-1)[0] = float("nan")
    save_file(state, str(w))
    _edit_json(p / "meta.json", lambda m: m["weights"].update(sha256=hashlib.sha256(w.read_bytes()).hexdigest()))


def _png_header(width: int, height: int) -> bytes:
    """A tiny PNG that declares ``width x height`` pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _local_workload(image: Callable[[Path], None]) -> Callable[..., tuple[list[str], Path]]:
    def make(good: dict[str, Path], tmp: Path) -> tuple[list[str], Path]:
        src = tmp / "src"
        src.mkdir()
        image(src / "img.png")
        (src / "s.jsonl").write_text(json.dumps({"id": "a", "benchmark": "mine", "split": "test", "source": "test",
                                                 "prompt": "p", "reference": "r", "image": "img.png"}) + "\n")
        cfg = _config(good, tmp, lambda c: c["workloads"].update(mine={
            "category": "VLM", "display_name": "Mine", "generator": "local", "path": str(src / "s.jsonl"), "seed": 1}))
        out = tmp / "wl"
        return ["prepare-workload", "--config", str(cfg), "--workload", "mine", "--out", str(out)], out

    return make


def _bomb(levels: int = 9, width: int = 9) -> str:
    """A flow sequence whose last element expands to width**levels scalars (under 1 KB of YAML)."""
    parts = ["&a0 [" + ",".join(["x"] * width) + "]"]
    parts += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def _config_bomb(key_line: str, replacement: str) -> Callable[..., tuple[list[str], None]]:
    text = CONFIG_TEXT.replace(key_line, replacement, 1)
    assert text != CONFIG_TEXT
    return _validate_text(text)


def _special_config(kind: str) -> Callable[..., tuple[list[str], None]]:
    def make(good: dict[str, Path], tmp: Path) -> tuple[list[str], None]:
        p = tmp / "c.yaml"
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "loop":
            p.symlink_to("c.yaml")
        return ["validate-config", "--config", str(p)], None

    return make


def _fifo_log(good: dict[str, Path], tmp: Path) -> tuple[list[str], None]:
    os.mkfifo(tmp / "log.csv")
    return _validate(_set("device.external_logs", [str(tmp / "log.csv")]))(good, tmp)


CONFIG_TEXT = (REPO / "config" / "config.yaml").read_text()
BUDGETS_LINE = next(line for line in CONFIG_TEXT.splitlines(keepends=True) if line.startswith("  budgets:"))

CASES = [
    # ---- routing records (validate-simulator): values
    Case("routing-topk-float", _sim(_on_events(lambda ev: ev.update(topk=ev["topk"].float()))),
         "'topk' has dtype float32, expected integer expert ids"),
    Case("routing-negative-id", _sim(_on_events(lambda ev: ev["topk"].fill_(-1))), "expert id -1, outside [0, 6)"),
    Case("routing-id-9999", _sim(_on_events(lambda ev: ev.update(topk=ev["topk"].int().index_fill_(1, torch.tensor([0]),
                                                                                                  9999)))),
         "expert id 9999, outside [0, 6)"),
    Case("routing-three-times-too-wide", _sim(_on_events(lambda ev: ev.update(topk=ev["topk"].repeat(1, 3)))),
         f"expected {K} expert ids per token"),
    Case("routing-nan-tokens-per-s", _sim(_on_row("tokens_per_s", float("nan"))),
         "tokens_per_s is nan, must be finite"),
    Case("routing-negative-hits", _sim(_on_row("hits", -3)), "hits=-3 must be >= 0"),
    Case("routing-recall-percent", _sim(_on_row("ready_recall", 50.0)), "ready_recall=50.0 must be <= 1"),
    Case("routing-layer-out-of-range", _sim(_on_events(lambda ev: ev.update(layer=7))), "layer=7 must be <= 1"),
    Case("routing-nan-scores", _sim(_on_events(lambda ev: ev.update(scores=torch.full((3, N), float("nan"))))),
         "'scores' holds NaN or Inf"),
    # ---- window profiles (validate-simulator)
    Case("profile-all-nan", _sim(profile_edit=_all_nan), "profile.json: compute.loop.head_s is nan, must be finite"),
    Case("profile-negative", _sim(profile_edit=_put("compute.opt.head_s", -5.0)),
         "profile.json: compute.opt.head_s=-5.0 must be >= 0"),
    Case("profile-inf-bandwidth", _sim(profile_edit=_put("physical_model.bandwidth_mbps", float("inf"))),
         "physical_model.bandwidth_mbps is inf"),
    Case("profile-no-n-layers", _sim(profile_edit=lambda p: p.pop("n_layers")),
         "profile.json: window profile lacks required key 'n_layers'"),
    Case("profile-n-layers-text", _sim(profile_edit=_put("n_layers", "eight")),
         "profile.json: n_layers must be an integer, got str 'eight'"),
    Case("profile-zero-experts", _sim(profile_edit=_put("n_experts", 0)), "profile.json: n_experts=0 must be > 0"),
    # ---- predictors
    Case("predictor-nan-weights", _simulate(pred_edit=_nan_weights), "predictor.safetensors: tensor"),
    Case("predictor-dims-text", _gather_params(lambda p: _edit_json(p / "meta.json",
                                                                    lambda m: m["dims"].update(n_layers="eight"))),
         "meta.json: dims.n_layers must be an integer, got str 'eight'"),
    Case("predictor-dims-negative", _gather_params(lambda p: _edit_json(p / "meta.json",
                                                                        lambda m: m["dims"].update(n_experts=-6))),
         "meta.json: dims.n_experts=-6 must be > 0"),
    # ---- traces
    Case("trace-empty", _verify(_empty_trace), "n_tokens=0 must be > 0"),
    Case("trace-no-shards", _verify(lambda t: _edit_json(t / "manifest.json", lambda m: m.update(shards=[]))),
         "lists no shards"),
    Case("trace-top-k-above-experts", _verify(lambda t: _edit_json(t / "manifest.json", lambda m: m.update(top_k=99))),
         f"top_k=99 > n_experts={N}"),
    Case("trace-shard-zero-tokens", _verify(lambda t: _edit_json(t / "manifest.json",
                                                                 lambda m: m["shards"][0].update(n_tokens=0))),
         "shards[0]: n_tokens=0 must be > 0"),
    Case("trace-expert-id-out-of-range", _verify(_rewrite_shard(lambda d: d["topk.0"].fill_(N + 3))),
         f"topk.0 holds expert id {N + 3}, outside [0, {N})"),
    Case("trace-nan-logits", _verify(_rewrite_shard(lambda d: d["logits.1"].fill_(float("nan")))),
         "tensor 'logits.1' holds NaN or Inf"),
    Case("trace-shard-symlink-loop", _verify(lambda t: _symlink_loop(t / "shard-00000.safetensors"), "trace-stats"),
         "which cannot be resolved (a symlink loop)"),
    # ---- external logs (collect-device-benchmarks)
    Case("external-model-newline-latex", _collect(_ext_file("e.csv", ",".join(EXTERNAL_ROW) + "\n" + ",".join(
        f'"{MODEL}\n\\input{{/etc/passwd}}"' if k == "model" else str(v) for k, v in EXTERNAL_ROW.items()) + "\n")),
         "column 'model' 'tiny-deepseek-vl2\\n\\\\input{/etc/passwd}' holds control character '\\n'"),
    Case("external-device-control-char", _collect(_ext_file("e.jsonl", json.dumps(
        {**EXTERNAL_ROW, "device": "pixel\x1b[2J"}) + "\n")),
         "e.jsonl:1: column 'device'"),
    # ---- config values and paths
    Case("config-duplicate-device-models", _validate(_set("device.models", ["tiny-qwen3-vl-moe", "tiny-qwen3-vl-moe"])),
         "device.models"),
    Case("config-1mb-path", _validate(_set("device.external_logs", ["x" * (1 << 20)])),
         "device.external_logs[0]': path too long"),
    Case("config-external-log-fifo", _fifo_log, "is a FIFO, not a regular file"),
    Case("config-alias-bomb-budgets", _config_bomb(BUDGETS_LINE, f"  budgets: {_bomb()}\n"),
         "YAML expands to more than"),
    Case("config-recursive-alias", _validate_text("a: &x [1, *x]\n"), "recursive YAML alias"),
    Case("config-fifo", _special_config("fifo"), "is a FIFO, not a regular file, expected config file"),
    Case("config-symlink-loop", _special_config("loop"), "a symlink loop, expected config file"),
    Case("config-too-long-path", lambda g, t: (["validate-config", "--config", str(t / ("c" * 300))], None),
         "path too long"),
    # ---- workload images (prepare-workload, generator local)
    Case("workload-png-bomb", _local_workload(lambda p: p.write_bytes(_png_header(100_000, 100_000))),
         "exceeds limit of 178956970 pixels, could be decompression bomb"),  # PIL's own check, in Image.open
    Case("workload-png-over-budget", _local_workload(lambda p: p.write_bytes(_png_header(10_000, 10_000))),
         "image of 10000 x 10000 pixels exceeds the budget of"),  # under PIL's limit, over ours
    Case("workload-image-fifo", _local_workload(lambda p: os.mkfifo(p)), "is a FIFO, not a regular file"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_value_is_one_clear_line(case: Case, good: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    argv, out = case.make(good, tmp_path)
    start = time.monotonic()
    rc, err = _run(argv, capsys)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2, err[-2000:]
    assert len(errors) == 1 and case.expect in errors[0], errors[0][:2000] if errors else err[-2000:]
    assert len(errors[0]) < 2500, f"error line of {len(errors[0])} characters"
    assert "Traceback" not in err and time.monotonic() - start < 60
    if out is not None:
        assert not out.exists(), f"{out} was written"


def test_valid_artefacts_pass_the_value_checks(tmp_path: Path) -> None:
    """The valid profile and routing record the cases break pass every check (the cases fail for their fault)."""
    profile = _profile()
    check_window_profile(profile, "profile.json", required=WINDOW_SHAPE_KEYS)
    record = load_tensor_tree(_routing(tmp_path), ROUTING_FORMAT, "routing record")
    check_routing_values(record, "r", L, N, K)
    for prof in sorted((REPO / "results" / "device" / "window").glob("*/profile.json")):  # real ones, when built
        check_window_profile(json.loads(prof.read_text()), str(prof), required=WINDOW_SHAPE_KEYS)


def test_trace_stats_says_it_checks_sizes_only(good: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte keeps the size: trace-stats exits 0 (documented) but says it did not hash, on stderr."""
    t = _copy(good["trace"], tmp_path / "trace")
    f = t / "shard-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    from specprefetch.cli import main

    assert main(["trace-stats", str(t)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["n_tokens"] > 0 and "contents not hashed (verify-traces" in out.err


def test_store_values_are_one_line(good: dict[str, Path], tmp_path: Path) -> None:
    """A store manifest layer without bytes, with bytes 'lots' or negative, a float count, a symlink-loop layer."""
    from specprefetch.runtime.core.store import ExpertStore

    def broken(name: str, edit: Callable[[Path], None]) -> str:
        s = _copy(good["store"], tmp_path / name)
        edit(s)
        with pytest.raises(SpecPrefetchError) as exc:  # StoreError, or the manifest-name check's ContractError
            ExpertStore(s)
        return str(exc.value)

    layer = lambda fn: lambda s: _edit_json(s / "manifest.json", lambda m: fn(m["layers"][0]))  # noqa: E731
    assert "layer 0: missing key 'bytes'" in broken("a", layer(lambda lay: lay.pop("bytes")))
    lots = broken("b", layer(lambda lay: lay.update(bytes="lots")))
    assert "layer 0: key 'bytes' must be int, got str 'lots'" in lots
    assert "layer 0: bytes=-1 must be > 0" in broken("c", layer(lambda lay: lay.update(bytes=-1)))
    assert "n_experts must be an integer, got float 6.5" in broken(
        "d", lambda s: _edit_json(s / "manifest.json", lambda m: m.update(n_experts=6.5)))
    msg = broken("e", lambda s: _symlink_loop(s / "layer-000.bin"))
    assert "layer-000.bin" in msg and "symlink loop" in msg


def test_render_tables_on_a_full_disk_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC when the second file of the rendering is renamed into place: no .tex or .json of this run is left."""
    import specprefetch.io as sio

    results = REPO / "paper_tables" / "results"
    replace, calls = os.replace, []

    def full_after_one(src: Any, dst: Any) -> None:
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(28, "No space left on device", str(dst))
        replace(src, dst)

    monkeypatch.setattr(sio.os, "replace", full_after_one)
    out = tmp_path / "tables"
    rc, err = _run(["render-tables", "--config", str(REPO / "config" / "config.yaml"), "--table", "table1_recall",
                    "--table", "table3_params", "--recall", str(results / "recall.csv"), "--params",
                    str(results / "params.csv"), "--out-dir", str(out)], capsys)
    assert rc == 2 and "No space left on device" in err and "Traceback" not in err
    assert len(calls) > 1 and not [p.name for p in out.iterdir()], [p.name for p in out.iterdir()]


def test_error_messages_are_bounded() -> None:
    """A hostile value quoted in an error cannot make the line megabytes long."""
    exc = SpecPrefetchError("f.yaml: bad value " + "x" * (10 << 20) + " (the fix)")
    assert len(str(exc)) < 2100 and str(exc).startswith("f.yaml: bad value") and str(exc).endswith("(the fix)")


def test_enough_cases() -> None:
    """Every failing case of issue 30 is here (ids unique)."""
    assert len(CASES) >= 35 and len({c.id for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------------------------- property-based
_hostile = st.sampled_from(HOSTILE_NUMBERS)
_scalar = st.sampled_from([v for v in HOSTILE_NUMBERS if not isinstance(v, (list, dict))])  # values, not shapes
_PROFILE_KEYS = ["n_layers", "n_experts", "top_k", "payload_bytes", "io_workers", "compute.loop.head_s",
                 "compute.opt.moe_s", "transfer_ms.ram.transfer_ms", "physical_model.latency_ms"]


def _valid_number(key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if key in WINDOW_SHAPE_KEYS:
        return isinstance(value, int) and value > 0 and (key != "n_experts" or value >= K) and (
            key != "top_k" or value <= N)
    return value == value and abs(value) != float("inf") and value >= 0


@_PROP
@given(key=st.sampled_from(_PROFILE_KEYS), value=_scalar)
def test_window_profile_values(key: str, value: Any) -> None:
    """Window profile: a hostile value at a key the simulator reads is one line naming profile.json and the key."""
    prof = _profile()
    *head, last = key.split(".")
    node = prof
    for k in head:
        node = node[k]
    node[last] = [value, 0.0] if isinstance(node[last], list) else value
    valid = _valid_number(key, value)
    if valid:
        check_window_profile(prof, "w/profile.json", required=WINDOW_SHAPE_KEYS)
        return
    with pytest.raises(ContractError) as exc:
        check_window_profile(prof, "w/profile.json", required=WINDOW_SHAPE_KEYS)
    msg = str(exc.value)
    assert msg.startswith("w/profile.json: ") and "\n" not in msg and (last in msg or "top_k" in msg)


@_PROP
@given(dtype=st.sampled_from([torch.int16, torch.int32, torch.int64, torch.uint8, torch.float32, torch.bool]),
       width=st.integers(0, 3 * K), lo=st.integers(-5, N + 5), span=st.integers(0, 3 * N),
       tokens=st.integers(0, 4))
def test_routing_record_values(tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype, width: int, lo: int,
                               span: int, tokens: int) -> None:
    """Routing record: topk of any dtype, width and id range is accepted iff integer, K wide and within [0, N)."""
    g = torch.Generator().manual_seed(lo * 31 + span)
    ids = torch.randint(lo, lo + span + 1, (tokens, width), generator=g)
    topk = ids.to(dtype)
    tree = {"runs": {"k": {"row": {"tokens_per_s": 1.0}, "events": [{"step": 0, "layer": 0, "topk": topk}]}}}
    exact = topk.to(torch.int64)
    valid = (not topk.is_floating_point() and dtype != torch.bool and width == K
             and (topk.numel() == 0 or (int(exact.min()) >= 0 and int(exact.max()) < N)))
    if valid:
        check_routing_values(tree, "r.safetensors", L, N, K)
        return
    with pytest.raises(ContractError) as exc:
        check_routing_values(tree, "r.safetensors", L, N, K)
    assert str(exc.value).startswith("r.safetensors run 'k' event 0: 'topk'")


@_PROP
@given(col=st.sampled_from(["tokens_per_s", "ready_recall", "hits", "stall_ms", "m_max"]), value=_hostile)
def test_routing_row_values(col: str, value: Any) -> None:
    """Routing record rows: NaN, Inf, negative, text, bool in a metric is one line naming the run and column."""
    tree = {"runs": {"k": {"row": {col: value}, "events": []}}}
    valid = (_valid_number(col, value) and (col != "tokens_per_s" or value > 0)
             and (col != "ready_recall" or value <= 1))
    if valid:
        check_routing_values(tree, "r", L, N, K)
        return
    with pytest.raises(ContractError) as exc:
        check_routing_values(tree, "r", L, N, K)
    assert str(exc.value).startswith("r run 'k' row: ") and col in str(exc.value)


@_PROP
@given(key=st.sampled_from(["n_tokens", "n_samples", "n_experts", "top_k", "hidden_size", "n_moe_layers",
                            "shards.0.n_tokens", "shards.0.bytes"]), value=_hostile)
def test_trace_manifest_values(good: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, key: str,
                               value: Any) -> None:
    """Trace manifest: a hostile count or size is one TraceError line naming manifest.json (never accepted)."""
    from specprefetch.traces.store import TraceReader

    t = _copy(good["trace"], tmp_path_factory.mktemp("t") / "trace")
    man = json.loads((t / "manifest.json").read_text())
    if key.startswith("shards."):
        man["shards"][0][key.split(".")[2]] = value
    else:
        man[key] = value
    (t / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(SpecPrefetchError) as exc:  # every hostile value is refused: none is a positive integer
        TraceReader(t, verify=False).check_sizes()
    msg = str(exc.value)
    assert "manifest.json" in msg and "\n" not in msg and key.split(".")[-1] in msg


@_PROP
@given(key=st.sampled_from(["n_experts", "n_layers", "record_bytes", "hidden_size", "alignment", "layers.0.bytes"]),
       value=_hostile)
def test_store_manifest_values(good: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, key: str,
                               value: Any) -> None:
    """Expert-store manifest: a hostile size or count is one StoreError line naming manifest.json."""
    from specprefetch.runtime.core.store import ExpertStore, StoreError

    s = _copy(good["store"], tmp_path_factory.mktemp("s") / "store")
    man = json.loads((s / "manifest.json").read_text())
    if key.startswith("layers."):
        man["layers"][0]["bytes"] = value
    else:
        man[key] = value
    (s / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(StoreError) as exc:
        ExpertStore(s, verify=False)
    assert "manifest.json" in str(exc.value) or "layer-000.bin" in str(exc.value)


@_PROP
@given(key=st.sampled_from(["n_layers", "hidden_size", "n_experts", "top_k"]), value=_hostile)
def test_predictor_dims_values(key: str, value: Any) -> None:
    """Predictor dims: anything but a positive integer is one line naming meta.json and dims.<key>."""
    dims = {"n_layers": L, "hidden_size": 8, "n_experts": N, "top_k": K, key: value}
    valid = isinstance(value, int) and not isinstance(value, bool) and value > 0 and dims["top_k"] <= dims["n_experts"]
    if valid:
        check_model_dims(dims, "p/meta.json")
        return
    with pytest.raises(ContractError) as exc:
        check_model_dims(dims, "p/meta.json")
    assert str(exc.value).startswith("p/meta.json: dims.")


@_PROP
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), where=st.integers(0, 63),
       bad=st.sampled_from([float("nan"), float("inf"), -float("inf"), None]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_tensor_values(shape: list[int], where: int, bad: float | None, dtype: torch.dtype) -> None:
    """Predictor weights, trace inputs and logits: one NaN or Inf anywhere is one line naming the tensor."""
    t = torch.zeros(shape, dtype=dtype)
    if bad is None:
        check_finite_tensors({"w": t, "ids": torch.arange(3)}, "p.safetensors")
        return
    t.view(-1)[where % t.numel()] = bad
    with pytest.raises(ContractError, match=r"^p\.safetensors: tensor 'w' holds NaN or Inf$"):
        check_finite_tensors({"ids": torch.arange(3), "w": t}, "p.safetensors")


@_PROP
@given(text=st.text(max_size=40), col=st.sampled_from(["model", "device", "notes"]))
def test_external_log_names(text: str, col: str) -> None:
    """External log names: text with a control character is one line naming file:line and column; other text is
    accepted as is (LaTeX specials are escaped when rendered)."""
    from specprefetch.runtime.measurement.external import ExternalLogError, validate_row

    raw = {**EXTERNAL_ROW, col: text}
    has_control = any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in text)
    if col == "model" and not text.strip():
        return  # an empty required column has its own message
    if has_control:
        with pytest.raises(ExternalLogError, match=rf"^e\.csv:2: column '{col}' "):
            validate_row(raw, "e.csv:2")
    else:
        row = validate_row(raw, "e.csv:2")
        assert col != "model" or row["model"] == text.strip()
        check_label(text, "e.csv:2", col, max_len=2000)


@_PROP
@given(levels=st.integers(1, 12), width=st.integers(1, 12))
def test_yaml_aliases_are_bounded(levels: int, width: int) -> None:
    """YAML aliases: a document is accepted iff its expansion stays under the bound, decided in well under a second
    and without expanding it (no MemoryError, no hang)."""
    from specprefetch.contracts import YAML_MAX_NODES

    sizes = [1 + width]  # a0: a sequence of ``width`` scalars; a_i: a sequence of ``width`` aliases of a_{i-1}
    for _ in range(1, levels):
        sizes.append(1 + width * sizes[-1])
    expanded = 3 + sum(sizes)  # the mapping, its key, the outer sequence
    start = time.monotonic()
    if expanded <= YAML_MAX_NODES:
        assert len(parse_yaml(f"budgets: {_bomb(levels, width)}\n", "c.yaml")["budgets"]) == levels
    else:
        with pytest.raises(ContractError, match=r"^c\.yaml:1: YAML expands to more than"):
            parse_yaml(f"budgets: {_bomb(levels, width)}\n", "c.yaml")
    assert time.monotonic() - start < 2.0


@_PROP
@given(kind=st.sampled_from(["regular", "missing", "directory", "fifo", "loop", "dangling", "long", "nul",
                             "file-as-dir", "device"]))
def test_paths_are_regular_files(tmp_path_factory: pytest.TempPathFactory, kind: str) -> None:
    """Paths: anything but a regular file that ends is one line before anything is opened (a FIFO never blocks)."""
    d = tmp_path_factory.mktemp("p")
    p = d / "f.yaml"
    if kind == "regular":
        p.write_text("a: 1\n")
    elif kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "loop":
        p.symlink_to("f.yaml")
    elif kind == "dangling":
        p.symlink_to("nowhere")
    elif kind == "long":
        p = d / ("x" * 5000)
    elif kind == "nul":
        p = Path(f"{d}/a\x00b")
    elif kind == "file-as-dir":
        p.write_text("")
        p = p / "inner.yaml"
    elif kind == "device":
        p = Path("/dev/null")
    if kind == "regular":
        assert regular_file(p, "config file") == p
        return
    with pytest.raises(ContractError) as exc:
        regular_file(p, "config file")
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 400 and ("config file" in msg or "path" in msg)


@_PROP
@given(width=st.integers(0, 1 << 20), height=st.integers(0, 1 << 20))
def test_pixel_budget(width: int, height: int) -> None:
    """Images: a header declaring more pixels than the budget (or none) is one line, checked before decoding."""
    from specprefetch.contracts import MAX_IMAGE_PIXELS

    if 0 < width * height <= MAX_IMAGE_PIXELS and width and height:
        check_pixel_budget((width, height), "img.png")
        return
    with pytest.raises(ContractError, match=r"^img\.png: image of "):
        check_pixel_budget((width, height), "img.png")


def test_config_yaml_still_loads() -> None:
    """The bound leaves every shipped config loadable (they use no aliases; a small anchor still works)."""
    for cfg in sorted((REPO / "config").glob("*.yaml")):
        assert isinstance(parse_yaml(cfg.read_text(), str(cfg)), dict)
    assert parse_yaml("a: &x [1, 2]\nb: *x\n", "c.yaml") == {"a": [1, 2], "b": [1, 2]}
    assert yaml.safe_load("a: 1") == {"a": 1}


def test_killed_prepare_corpus_spill_is_removed_on_rerun(smoke_cfg: dict[str, Any], tmp_path: Path) -> None:
    """A SIGKILLed prepare-corpus leaves its image spill directory; the rerun removes it (one job owns the corpus)."""
    import copy

    from specprefetch.data.corpus import prepare_train_corpus

    stale = tmp_path / ".corpus.images-k1ll3d00"
    (stale / "x").mkdir(parents=True)
    (stale / "x" / "00001.png").write_bytes(b"partial")
    other = tmp_path / ".other.images-k1ll3d00"  # another target's spill is not this job's to remove
    other.mkdir()
    cfg = copy.deepcopy(smoke_cfg)
    prepare_train_corpus(cfg, tmp_path / "corpus")
    assert (tmp_path / "corpus" / "manifest.json").is_file()
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.images-k1ll3d00", "corpus"]
