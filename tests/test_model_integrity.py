"""Model integrity (issue 15): recorded weight checksums, truncated files, tokenizer files, checkpoint/config
mismatches -- each a one-line error naming the file, raised before transformers reads any weights.

The stand-ins are built once (untrained, seed 0) from the shared tiny tokenizer and copied per test.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specprefetch.config import ConfigError
from specprefetch.io import SpecPrefetchError, sha256_file
from specprefetch.models import load_bundle
from specprefetch.models.standins import (
    META_FILE,
    STANDIN_FORMAT,
    StandInError,
    WeightsError,
    build_stand_in,
    safetensors_header,
    save_stand_in,
)

REPO = Path(__file__).resolve().parent.parent
QWEN, DEEPSEEK = "tiny-qwen3-vl-moe", "tiny-deepseek-vl2"
WEIGHTS = {QWEN: ["model.safetensors"],
           DEEPSEEK: ["language/model.safetensors", "projector.safetensors", "vision/model.safetensors"]}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, smoke_cfg: dict[str, Any],
             tiny_tokenizer: Any) -> dict[str, Path]:
    out = {}
    for name in (QWEN, DEEPSEEK):
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp("pristine") / name
        save_stand_in(build_stand_in(smoke_cfg, name, tiny_tokenizer), d)
        out[name] = d
    return out


@pytest.fixture
def standin(pristine: dict[str, Path], tmp_path: Path) -> Any:
    """``standin(name)``: a fresh copy of the saved stand-in, free to damage."""
    n = iter(range(1_000))

    def copy_of(name: str) -> Path:
        d = tmp_path / f"{next(n)}" / name
        shutil.copytree(pristine[name], d)
        return d
    return copy_of


@pytest.fixture
def no_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if transformers is asked to read model weights."""
    from transformers import PreTrainedModel

    def boom(cls: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError(f"{cls.__name__}.from_pretrained ran before the check")
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(boom))


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset  # in the tensor data: loads silently without the check
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_json(path: Path, fn: Any) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------ the record
@pytest.mark.parametrize("name", [QWEN, DEEPSEEK])
def test_save_records_every_weight_file_and_intact_loads(name: str, smoke_cfg: dict[str, Any], standin: Any) -> None:
    d = standin(name)
    meta = json.loads((d / META_FILE).read_text())
    assert meta["format"] == STANDIN_FORMAT == "specprefetch-standin/2"
    assert sorted(meta["weights"]) == WEIGHTS[name]
    for rel, rec in meta["weights"].items():
        assert rec == {"sha256": sha256_file(d / rel), "bytes": (d / rel).stat().st_size}
    bundle = load_bundle(smoke_cfg, name, d)
    assert bundle.kind == "stand_in" and bundle.meta["weights"] == meta["weights"]


# ------------------------------------------------------------------------------------------ corrupt weights
@pytest.mark.parametrize("name,rel", [(QWEN, "model.safetensors"), (DEEPSEEK, "language/model.safetensors"),
                                      (DEEPSEEK, "vision/model.safetensors"), (DEEPSEEK, "projector.safetensors")])
def test_flipped_byte_is_caught_before_loading(name: str, rel: str, smoke_cfg: dict[str, Any], standin: Any,
                                               no_from_pretrained: None) -> None:
    d = standin(name)
    _flip(d / rel)
    with pytest.raises(WeightsError) as err:
        load_bundle(smoke_cfg, name, d)
    assert _one_line(err.value) == (f"{d / rel}: sha256 does not match the one recorded in {d / META_FILE} "
                                    "(corrupt or replaced weights)")


def test_flipped_byte_in_header_is_caught(smoke_cfg: dict[str, Any], standin: Any) -> None:
    """A flip in a tensor name made transformers re-initialise that tensor and load on."""
    d = standin(QWEN)
    path = d / "model.safetensors"
    _flip(path, 8 + 40)
    with pytest.raises(WeightsError, match="sha256 does not match"):
        load_bundle(smoke_cfg, QWEN, d)


@pytest.mark.parametrize("name,rel", [(QWEN, "model.safetensors"), (DEEPSEEK, "language/model.safetensors")])
def test_truncated_standin_weights(name: str, rel: str, smoke_cfg: dict[str, Any], standin: Any,
                                   no_from_pretrained: None) -> None:
    d = standin(name)
    data = (d / rel).read_bytes()
    (d / rel).write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError) as err:
        load_bundle(smoke_cfg, name, d)
    msg = _one_line(err.value)
    assert msg.startswith(f"{d / rel}: sha256 does not match the one recorded in {d / META_FILE}")
    assert f"{len(data) // 2} bytes where {len(data)} were recorded" in msg


def test_missing_and_unlisted_weight_files(smoke_cfg: dict[str, Any], standin: Any, no_from_pretrained: None) -> None:
    d = standin(DEEPSEEK)
    (d / "vision" / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"vision/model\.safetensors: weight file missing \(recorded in .*"
                                           r"re-run pretrain-stand-in"):
        load_bundle(smoke_cfg, DEEPSEEK, d)

    d = standin(QWEN)
    shutil.copy(d / "model.safetensors", d / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightsError) as err:
        load_bundle(smoke_cfg, QWEN, d)
    assert _one_line(err.value).startswith(f"{d / 'model-00002-of-00002.safetensors'}: weight file not recorded in "
                                           f"{d / META_FILE}")

    d = standin(DEEPSEEK)
    (d / "language" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(WeightsError, match=r"language/pytorch_model\.bin: weight file not recorded"):
        load_bundle(smoke_cfg, DEEPSEEK, d)


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/x.safetensors", "vision/../../x.safetensors",
                                 "./model.safetensors", "a\\..\\x.safetensors", ""])
def test_record_names_must_stay_inside(bad: str, smoke_cfg: dict[str, Any], standin: Any,
                                       no_from_pretrained: None) -> None:
    d = standin(QWEN)
    _edit_json(d / META_FILE, lambda m: m["weights"].__setitem__(bad, m["weights"]["model.safetensors"]))
    with pytest.raises(StandInError) as err:
        load_bundle(smoke_cfg, QWEN, d)
    assert _one_line(err.value).startswith(f"{d / META_FILE}: weight file name {bad!r} is not a plain relative "
                                           "path inside the model directory")


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("weights"), "no 'weights' record"),
    (lambda m: m["weights"]["model.safetensors"].__setitem__("sha256", "abc"), "64 hex digits"),
    (lambda m: m.update(format="specprefetch-standin/1"),
     r"format 'specprefetch-standin/1' is not the current 'specprefetch-standin/2'.*re-run pretrain-stand-in"),
])
def test_record_must_be_current_and_well_formed(edit: Any, match: str, smoke_cfg: dict[str, Any], standin: Any) -> None:
    d = standin(QWEN)
    _edit_json(d / META_FILE, edit)
    with pytest.raises(StandInError, match=match) as err:
        load_bundle(smoke_cfg, QWEN, d)
    _one_line(err.value)


def test_cli_reports_corrupt_weights_in_one_line(standin: Any) -> None:
    d = standin(DEEPSEEK)
    _flip(d / "language" / "model.safetensors")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "specprefetch", "inspect-model", "--config",
                           str(REPO / "config" / "smoke.yaml"), "--model", DEEPSEEK, "--model-dir", str(d)],
                          check=False, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        (f"specprefetch inspect-model: error: {d / 'language' / 'model.safetensors'}: sha256 does not match the one "
         f"recorded in {d / META_FILE} (corrupt or replaced weights)")]


def test_cli_inspect_model_intact(pristine: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from specprefetch.cli import main

    rc = main(["inspect-model", "--config", str(REPO / "config" / "smoke.yaml"), "--model", QWEN,
               "--model-dir", str(pristine[QWEN])])
    assert rc == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["n_experts"] == 16


# ------------------------------------------------------------------------------------------ no recorded hash
def _local_cfg(smoke_cfg: dict[str, Any], d: Path) -> dict[str, Any]:
    cfg = copy.deepcopy(smoke_cfg)
    entry = {**cfg["models"][QWEN], "source": "local", "path": str(d)}
    entry.pop("pretrain", None)
    cfg["models"]["local-qwen"] = entry
    return cfg


def test_truncated_local_checkpoint_names_the_file(smoke_cfg: dict[str, Any], standin: Any,
                                                   no_from_pretrained: None) -> None:
    d = standin(QWEN)
    (d / META_FILE).unlink()  # a plain transformers checkpoint: no hashes recorded
    path = d / "model.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(WeightsError) as err:
        load_bundle(_local_cfg(smoke_cfg, d), "local-qwen")
    assert _one_line(err.value) == (f"{path}: truncated safetensors file ({size // 2} bytes, its header describes "
                                    f"{size})")


def test_local_checkpoint_missing_shard_and_expert_mismatch(smoke_cfg: dict[str, Any], standin: Any,
                                                            no_from_pretrained: None) -> None:
    d = standin(QWEN)
    (d / META_FILE).unlink()
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"model-00001-of-00002\.safetensors: weight shard missing \(listed in "):
        load_bundle(_local_cfg(smoke_cfg, d), "local-qwen")
    (d / "model.safetensors.index.json").unlink()

    cfg = _local_cfg(smoke_cfg, d)
    cfg["models"]["local-qwen"]["n_experts"] = 12
    with pytest.raises(ConfigError) as err:
        load_bundle(cfg, "local-qwen")
    assert _one_line(err.value) == (f"{d / 'config.json'}: the checkpoint has num_local_experts=16, but config key "
                                    "'models.local-qwen.n_experts' is 12 (wrong checkpoint, or fix the config)")


@pytest.mark.parametrize("data,match", [
    (b"\x01\x02", r"truncated safetensors file \(2 bytes, no header\)"),
    ((10_000).to_bytes(8, "little") + b"{}", r"truncated safetensors file \(10 bytes, its header alone is 10000"),
    ((4).to_bytes(8, "little") + b"{x:1", r"corrupt safetensors file \(its header is not valid JSON\)"),
])
def test_safetensors_header_names_the_file(data: bytes, match: str, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    with pytest.raises(WeightsError, match=match) as err:
        safetensors_header(path)
    assert _one_line(err.value).startswith(f"{path}: ")


def test_safetensors_header_reads_a_whole_file(pristine: dict[str, Path]) -> None:
    table = safetensors_header(pristine[QWEN] / "model.safetensors")
    assert table["model.language_model.layers.0.mlp.gate.weight"]["shape"] == [16, 32]


# ------------------------------------------------------------------------------------------ tokenizer files
@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_tokenizer_file_in_standin(missing: str, smoke_cfg: dict[str, Any], standin: Any) -> None:
    d = standin(QWEN)
    (d / missing).unlink()
    with pytest.raises(SpecPrefetchError) as err:
        load_bundle(smoke_cfg, QWEN, d)
    msg = _one_line(err.value)
    assert msg.startswith(f"{d}: tokenizer file {missing} missing") and "special token" not in msg


def test_corrupt_tokenizer_json_in_standin(smoke_cfg: dict[str, Any], standin: Any) -> None:
    d = standin(DEEPSEEK)
    (d / "tokenizer.json").write_text('{"truncated')
    with pytest.raises(SpecPrefetchError, match=rf"^{d}: cannot load the tokenizer \(JSONDecodeError") as err:
        load_bundle(smoke_cfg, DEEPSEEK, d)
    _one_line(err.value)


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_tokenizer_file_for_pretrain(missing: str, smoke_cfg: dict[str, Any], tiny_tokenizer_dir: Path,
                                             tiny_corpus_dir: Path, tmp_path: Path) -> None:
    from specprefetch.models.pretrain import pretrain_stand_in

    tok = tmp_path / "tokenizer"
    shutil.copytree(tiny_tokenizer_dir, tok)
    (tok / missing).unlink()
    with pytest.raises(SpecPrefetchError) as err:
        pretrain_stand_in(smoke_cfg, QWEN, tiny_corpus_dir, tok, tmp_path / "out")
    assert _one_line(err.value) == f"{tok}: tokenizer file {missing} missing (run train-tokenizer)"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ checkpoint vs config
@pytest.mark.parametrize("name,key,value,ck_file,ck_key,ck_value", [
    (QWEN, "n_experts", 12, "config.json", "num_local_experts", 16),
    (DEEPSEEK, "n_experts", 12, "language/config.json", "n_routed_experts", 8),
    (DEEPSEEK, "top_k", 3, "language/config.json", "num_experts_per_tok", 2),
    (QWEN, "hidden_size", 64, "config.json", "hidden_size", 32),
])
def test_config_mismatch_is_one_line_before_loading(name: str, key: str, value: int, ck_file: str, ck_key: str,
                                                    ck_value: int, smoke_cfg: dict[str, Any], standin: Any,
                                                    no_from_pretrained: None) -> None:
    d = standin(name)
    cfg = copy.deepcopy(smoke_cfg)
    cfg["models"][name][key] = value
    with pytest.raises(ConfigError) as err:
        load_bundle(cfg, name, d)
    assert _one_line(err.value) == (f"{d / ck_file}: the checkpoint has {ck_key}={ck_value}, but config key "
                                    f"'models.{name}.{key}' is {value} (wrong checkpoint, or fix the config)")


def test_weights_from_another_model_than_config_json(smoke_cfg: dict[str, Any], standin: Any,
                                                     no_from_pretrained: None) -> None:
    """config.json says 12 experts (as the config does), the weights hold 8: was transformers' "look at the
    above report" error."""
    d = standin(DEEPSEEK)
    _edit_json(d / "language" / "config.json", lambda c: c.update(n_routed_experts=12))
    cfg = copy.deepcopy(smoke_cfg)
    cfg["models"][DEEPSEEK]["n_experts"] = 12
    with pytest.raises(WeightsError) as err:
        load_bundle(cfg, DEEPSEEK, d)
    assert _one_line(err.value) == (
        f"{d / 'language' / 'model.safetensors'}: tensor model.layers.1.mlp.gate.weight has 8 experts (shape "
        f"[8, 32]), but {d / 'language' / 'config.json'} says n_routed_experts=12 (the weights and config.json are "
        "from different models)")


def test_other_shape_mismatch_is_one_line(smoke_cfg: dict[str, Any], standin: Any) -> None:
    """A mismatch the gate check does not see (the MoE FFN width) still gives one line, not the report error."""
    d = standin(DEEPSEEK)
    _edit_json(d / "language" / "config.json", lambda c: c.update(moe_intermediate_size=24))
    with pytest.raises(WeightsError) as err:
        load_bundle(smoke_cfg, DEEPSEEK, d)
    assert _one_line(err.value) == (
        f"{d / 'language'}: tensor shapes of the weights do not match {d / 'language' / 'config.json'} "
        "(model.layers.1.mlp.experts.down_proj is [8, 32, 16] in the weights, [8, 32, 24] by config.json and 9 "
        "more; the weights and config.json are from different models)")


def test_renamed_tensor_is_not_reinitialised(smoke_cfg: dict[str, Any], standin: Any) -> None:
    """With the record rewritten to match (no hash protection), a renamed tensor is still an error, not a
    silently re-initialised parameter."""
    from specprefetch.models.standins import record_weights

    d = standin(QWEN)
    path = d / "model.safetensors"
    data = path.read_bytes()
    key = b"model.visual.blocks.0.norm1.bias"
    assert key in data
    path.write_bytes(data.replace(key, b"model.visual.blocks.0.norm1.bi`s", 1))
    _edit_json(d / META_FILE, lambda m: m.update(weights=record_weights(d)))
    with pytest.raises(WeightsError) as err:
        load_bundle(smoke_cfg, QWEN, d)
    assert _one_line(err.value) == (f"{d}: the weights do not fit the model of {d / 'config.json'} (missing keys: "
                                    "model.visual.blocks.0.norm1.bias; corrupt or replaced weights)")
