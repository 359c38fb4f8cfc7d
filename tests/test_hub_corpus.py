"""The training corpus from real instruction datasets (``train_corpus.hub``, specprefetch.data.hub_corpus).

The datasets are tiny records in the real schemas, put under their hub ids in an offline Hugging Face cache with
tests/hub_mirror.py's writer (the layout an online ``load_dataset`` leaves), so the corpus code's exact
``load_dataset(path, name, split=..., revision=...)`` call runs:

- lmms-lab/LLaVA-OneVision-Data: one config per subset; ``id``, ``image``, ``conversations [{from, value}]``,
  ``data_source`` (the dataset card's ``dataset_info``);
- HuggingFaceM4/the_cauldron: one config per source; ``images`` (a list), ``texts [{user, assistant, source}]``;
- HuggingFaceH4/ultrachat_200k: config ``default``, split ``train_sft``; ``prompt``, ``prompt_id``,
  ``messages [{content, role}]``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hub_mirror import CAULDRON, OV, ULTRACHAT, _ov_rows, _ultrachat_rows  # noqa: E402

from specprefetch.config import REPO_ROOT, load_config, validate_config
from specprefetch.data import hub_corpus as hc
from specprefetch.data.corpus import DisjointnessError, check_disjoint, mixture_counts, prepare_train_corpus
from specprefetch.data.workloads import prepare_workload, read_manifest, read_workload
from specprefetch.io import SpecPrefetchError, sha256_file

GSM8K_TEST_Q = "Tom has 5 apples and eats 2. How many are left?"  # in hub_mirror's openai/gsm8k test split
CHARTQA_TEST_IMAGE_SEED = 102  # hub_mirror's HuggingFaceM4/ChartQA test row 0 (chart(2, ...) -> _img(100 + 2))


# ------------------------------------------------------------------------------------------ the mirror
def _specs() -> list[dict[str, Any]]:
    """The mirror's corpus datasets plus two planted leaks (a ChartQA test image, a GSM8K test question)."""
    import hub_mirror as hm
    planted = {  # in configs of their own, so the clean entries stay clean
        "ai2d(gpt4v)": [{"id": "leak-img", "image": hm._img(CHARTQA_TEST_IMAGE_SEED), "data_source": "ai2d",
                         "conversations": [{"from": "human", "value": "<image>\nWhat does the chart show?"},
                                           {"from": "gpt", "value": "Food items."}]}],
        "magpie_pro(qwen2_72b_st)": [{"id": "leak-txt", "image": None, "data_source": "magpie",
                                      "conversations": [{"from": "human",
                                                         "value": f"Question: {GSM8K_TEST_Q}\nAnswer:"},
                                                        {"from": "gpt", "value": "3"}]}]}
    specs = hm.corpus_specs(extra_onevision=planted)
    specs += [b for b in hm.benchmark_specs() if b["repo_id"] in ("HuggingFaceM4/ChartQA", "openai/gsm8k")]
    return specs


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import hub_mirror as hm

    root = tmp_path_factory.mktemp("hf_home")
    for spec in _specs():
        hm.write_benchmark(root, spec)
    return root


@pytest.fixture
def offline(mirror: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads datasets only from the mirror (what HF_HUB_OFFLINE=1 HF_HOME=<mirror> does)."""
    import datasets
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", mirror / "datasets")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(mirror / "hub"))
    return mirror


ENTRIES = [
    {"path": OV, "name": "sharegpt4v(coco)", "weight": 0.4},
    {"path": OV, "name": "magpie_pro(l3_80b_st)", "weight": 0.2},
    {"path": CAULDRON, "name": "vqav2", "weight": 0.2},
    {"path": ULTRACHAT, "split": "train_sft", "weight": 0.2},
]


def corpus_cfg(entries: list[dict[str, Any]] = ENTRIES, n: int = 20, seed: int = 7, **extra: Any) -> dict:
    """The smoke profile with ``train_corpus`` = these hub entries (resolved: schema defaults filled in)."""
    cfg = copy.deepcopy(load_config(REPO_ROOT / "config/smoke.yaml"))
    cfg["train_corpus"] = {"seed": seed, "n_samples": n, "hub": copy.deepcopy(entries), **extra}
    return validate_config(cfg, REPO_ROOT)


def _manifest(d: Path) -> dict[str, Any]:
    return read_manifest(d)["provenance"]


# ------------------------------------------------------------------------------------------ mappings
def test_mappings_follow_the_real_schemas() -> None:
    from PIL import Image

    img = Image.new("RGB", (8, 6), "red")
    llava = {"id": "a", "image": img, "data_source": "x", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "A red square."}, {"from": "human", "value": "Size?"},
        {"from": "gpt", "value": "8x6"}]}
    d = hc.map_llava(llava, "first", set(), "r")
    assert (d.prompt, d.reference, d.image.size, d.meta["id"]) == ("What is it?", "A red square.", (8, 6), "a")
    d = hc.map_llava(llava, "all", set(), "r")
    assert d.prompt == "User: What is it?\n\nAssistant: A red square.\n\nUser: Size?" and d.reference == "8x6"
    with pytest.raises(hc.Skip, match="excluded_source"):
        hc.map_llava(llava, "first", {"x"}, "r")
    cauldron = {"images": [img], "texts": [{"user": "Q1?", "assistant": "A1.", "source": "vqav2"},
                                           {"user": "Q2?", "assistant": "A2.", "source": "vqav2"}]}
    d = hc.map_cauldron(cauldron, "first", set(), "r")
    assert (d.prompt, d.reference, d.image.mode) == ("Q1?", "A1.", "RGB")
    with pytest.raises(hc.Skip, match="multi_image"):
        hc.map_cauldron({**cauldron, "images": [img, img]}, "first", set(), "r")
    msgs = {"prompt_id": "p", "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                              "text": "Hi?"}]},
                                           {"role": "assistant", "content": "Hello."}]}
    d = hc.map_messages(msgs, "first", set(), "r")
    assert (d.prompt, d.reference, d.image) == ("Hi?", "Hello.", None)
    with pytest.raises(hc.Skip, match="no_dialogue"):
        hc.map_messages({"messages": [{"role": "user", "content": "Hi?"}]}, "first", set(), "r")
    assert hc.detect_corpus_format({"path": OV}, [], "w") == "llava"
    assert hc.detect_corpus_format({"path": "me/copy"}, ["images", "texts"], "w") == "cauldron"
    assert hc.detect_corpus_format({"path": "me/copy", "format": "messages"}, ["x"], "w") == "messages"
    with pytest.raises(SpecPrefetchError, match=r"train_corpus.hub\[3\] 'me/other': columns \['q'\] match no") as e:
        hc.detect_corpus_format({"path": "me/other"}, ["q"], "train_corpus.hub[3]")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ the corpus
def test_hub_corpus_from_the_offline_cache(offline: Path, tmp_path: Path) -> None:
    import hub_mirror as hm

    cfg = corpus_cfg()
    prepare_train_corpus(cfg, tmp_path / "corpus")
    samples = read_workload(tmp_path / "corpus")
    keys = [hc.source_key(e) for e in cfg["train_corpus"]["hub"]]
    want = mixture_counts(dict(zip(keys, (e["weight"] for e in ENTRIES))), 20)
    prov = _manifest(tmp_path / "corpus")
    assert prov["mixture_counts"] == want == {keys[0]: 8, keys[1]: 4, keys[2]: 4, keys[3]: 4}
    assert len(samples) == 20 and {s.split for s in samples} == {"train"}
    assert sum(s.image is not None for s in samples) == 12  # sharegpt4v + vqav2 have images; magpie, ultrachat not
    assert not any("<image>" in s.prompt for s in samples)
    by_source = {s.source.rsplit(" ", 1)[0] for s in samples}
    assert by_source == {f"hub {OV} name=sharegpt4v(coco) split=train revision=main",
                         f"hub {OV} name=magpie_pro(l3_80b_st) split=train revision=main",
                         f"hub {CAULDRON} name=vqav2 split=train revision=main",
                         f"hub {ULTRACHAT} split=train_sft revision=main"}
    rows = _ov_rows("sharegpt4v", 12)
    for s in samples:
        if s.meta["dataset"] == OV and s.meta["config"] == "sharegpt4v(coco)":
            i = s.meta["index"]
            assert i != 5 and s.prompt == f"Describe picture {i} in detail." and s.meta["id"] == rows[i]["id"]
            assert s.reference == f"Picture {i} shows {i + 2} boats on a lake."
        if s.meta["dataset"] == CAULDRON:
            assert s.meta["index"] != 2 and s.reference == "Red."
    hub = {(p["path"], p["name"]): p for p in prov["hub"]}
    sg = hub[(OV, "sharegpt4v(coco)")]
    assert sg["resolved_commit"] == hm.fake_commit("dataset", OV) and sg["revision"] == "main"
    assert sg["format"] == "llava" and sg["n_records"] == 12 and sg["n_taken"] == 8 and len(sg["indices"]) == 8
    assert set(sg["skipped"]) <= {"no_dialogue"} and set(hub[(CAULDRON, "vqav2")]["skipped"]) <= {"multi_image"}
    assert sorted(sg["indices"]) == sorted(s.meta["index"] for s in samples if s.meta.get("config") ==
                                           "sharegpt4v(coco)")
    assert hub[(CAULDRON, "vqav2")]["format"] == "cauldron" and hub[(ULTRACHAT, None)]["format"] == "messages"


def test_hub_images_spill_to_files(offline: Path, tmp_path: Path) -> None:
    """With a spill directory the drafts hold files, not PNG bytes (memory does not grow with the corpus), and the
    images are the same bytes; prepare_train_corpus spills and leaves no spill directory behind."""
    from specprefetch.config import section_defaults

    entries = [section_defaults("corpus_dataset", e) for e in ENTRIES[:1]]
    keys = [hc.source_key(e) for e in entries]
    in_memory, _ = hc.hub_corpus_drafts(entries, {keys[0]: 5}, {keys[0]: 3})
    spilled, _ = hc.hub_corpus_drafts(entries, {keys[0]: 5}, {keys[0]: 3}, spill=tmp_path / "spill")
    assert [d.prompt for d, _ in in_memory[keys[0]]] == [d.prompt for d, _ in spilled[keys[0]]]
    for (a, _), (b, _) in zip(in_memory[keys[0]], spilled[keys[0]]):
        assert isinstance(a.image, bytes) and isinstance(b.image, Path) and b.image.read_bytes() == a.image
    prepare_train_corpus(corpus_cfg(), tmp_path / "out" / "corpus")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["corpus"]


def test_hub_corpus_is_seeded(offline: Path, tmp_path: Path) -> None:
    def build(name: str, seed: int, **entry: Any) -> tuple[str, dict[str, str]]:
        entries = [{**e, **entry} for e in ENTRIES]
        prepare_train_corpus(corpus_cfg(entries, seed=seed), tmp_path / name)
        d = tmp_path / name
        return sha256_file(d / "samples.jsonl"), {p.name: sha256_file(p) for p in sorted((d / "images").iterdir())}

    a = build("a", 7)
    assert build("b", 7) == a
    assert build("c", 8)[0] != a[0]
    s1 = build("s1", 7, streaming=True, shuffle_buffer=4)
    assert build("s2", 7, streaming=True, shuffle_buffer=4) == s1
    lines = [json.loads(x) for x in (tmp_path / "s1" / "samples.jsonl").read_text().splitlines()]
    assert all("position" in x["meta"] and " position=" in x["source"] for x in lines)


def test_hub_corpus_weights_and_shortfall(offline: Path, tmp_path: Path) -> None:
    # dvqa has 3 records but a 50% share of 16: it gives 3 and the other entries share the 5 left by weight
    entries = [{"path": OV, "name": "dvqa(cauldron,llava_format)", "weight": 0.5},
               {"path": OV, "name": "magpie_pro(l3_80b_st)", "weight": 0.25},
               {"path": ULTRACHAT, "split": "train_sft", "weight": 0.25}]
    prepare_train_corpus(corpus_cfg(entries, n=16), tmp_path / "short")
    counts = _manifest(tmp_path / "short")["mixture_counts"]
    keys = [hc.source_key(e) for e in entries]
    assert counts == {keys[0]: 3, keys[1]: 4 + 3, keys[2]: 4 + 2} and len(read_workload(tmp_path / "short")) == 16
    with pytest.raises(SpecPrefetchError, match=r"hold 19 usable records, 40 wanted"):
        prepare_train_corpus(corpus_cfg(entries, n=40), tmp_path / "too_many")
    assert not (tmp_path / "too_many").exists()
    # synthetic and hub sources mix by their weights together
    hub = [{**entries[1], "weight": 0.25}, {**entries[2], "weight": 0.5}]
    prepare_train_corpus(corpus_cfg(hub, n=12, mixture={"gsm8k_synth": 0.5, "stdlib_docs": 0.25}), tmp_path / "mixed")
    assert _manifest(tmp_path / "mixed")["mixture_counts"] == {"gsm8k_synth": 4, "stdlib_docs": 2, keys[1]: 2,
                                                                keys[2]: 4}
    with pytest.raises(SpecPrefetchError, match="listed twice"):
        prepare_train_corpus(corpus_cfg([entries[1], entries[1]]), tmp_path / "dup")


def test_disjointness_check_runs_on_the_hub_corpus_and_catches_planted_samples(offline: Path, tmp_path: Path) -> None:
    """check_disjoint (rule check_disjoint: `specprefetch check-disjoint`) vs hub benchmark workloads: a clean
    hub corpus passes; a ChartQA test image or a GSM8K test question inside a corpus dataset fails it."""
    from specprefetch.cli import main

    cfg = corpus_cfg(n=12)
    cfg["workloads"] = {
        "chartqa": {"category": "VLM", "display_name": "ChartQA-Test", "generator": "hub", "seed": 14,
                    "dataset": {"path": "HuggingFaceM4/ChartQA", "split": "test", "revision": "main"}},
        "gsm8k": {"category": "LLM", "display_name": "GSM8K", "generator": "hub", "seed": 11,
                  "dataset": {"path": "openai/gsm8k", "name": "main", "split": "test", "revision": "main"}}}
    workloads = []
    for name in cfg["workloads"]:
        prepare_workload(cfg, name, tmp_path / "workloads" / name)
        workloads.append(tmp_path / "workloads" / name)
    prepare_train_corpus(cfg, tmp_path / "clean")
    out = tmp_path / "disjoint.json"
    assert main(["check-disjoint", "--corpus", str(tmp_path / "clean"), "--workloads", *map(str, workloads),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overlaps"] == 0 and report["corpus"]["n_samples"] == 12 and set(report["workloads"]) == {
        "chartqa", "gsm8k"}
    planted = ENTRIES + [{"path": OV, "name": "ai2d(gpt4v)", "weight": 0.05}]
    prepare_train_corpus(corpus_cfg(planted, n=24), tmp_path / "leak_img")
    with pytest.raises(DisjointnessError, match=r"image: corpus sample corpus-\d+ = chartqa/chartqa-\d+"):
        check_disjoint(tmp_path / "leak_img", workloads)
    planted = ENTRIES + [{"path": OV, "name": "magpie_pro(qwen2_72b_st)", "weight": 0.05}]
    prepare_train_corpus(corpus_cfg(planted, n=24), tmp_path / "leak_txt")
    with pytest.raises(DisjointnessError, match=r"prompt: corpus sample corpus-\d+ = gsm8k/gsm8k-\d+"):
        check_disjoint(tmp_path / "leak_txt", workloads)
    assert main(["check-disjoint", "--corpus", str(tmp_path / "leak_txt"), "--workloads", *map(str, workloads)]) != 0


# ------------------------------------------------------------------------------------------ local copies, errors
def test_local_copies_and_one_line_errors(mirror: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import hub_mirror as hm
    import huggingface_hub.constants as hf_constants

    # `hf download --repo-type dataset ... --local-dir DIR` leaves the repository's files: path: DIR, name as on the hub
    snap = mirror / "hub" / "datasets--lmms-lab--LLaVA-OneVision-Data" / "snapshots" / hm.fake_commit("dataset", OV)
    prepare_train_corpus(corpus_cfg([{"path": str(snap), "name": "magpie_pro(l3_80b_st)", "weight": 1.0}], n=10),
                         tmp_path / "from_dir")
    assert {s.prompt for s in read_workload(tmp_path / "from_dir")} == {
        r["conversations"][0]["value"] for r in _ov_rows("magpie", 10)}

    rows = _ultrachat_rows(5)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "uc.parquet"))
    entries = [{"path": str(tmp_path / "saved"), "weight": 1.0}]
    prepare_train_corpus(corpus_cfg(entries, n=5), tmp_path / "from_disk")
    entries = [{"path": "parquet", "data_files": str(tmp_path / "uc.parquet"), "weight": 1.0}]
    prepare_train_corpus(corpus_cfg(entries, n=5), tmp_path / "from_parquet")
    a, b = (read_workload(tmp_path / d) for d in ("from_disk", "from_parquet"))
    assert sorted(s.prompt for s in a) == sorted(s.prompt for s in b)  # the order's seed derives from the path
    assert {s.prompt for s in a} == {r["prompt"] for r in rows} and all(s.image is None for s in a)
    datasets.Dataset.from_list([{"q": "x", "a": "y"}]).save_to_disk(str(tmp_path / "odd"))
    with pytest.raises(SpecPrefetchError, match=r"train_corpus.hub\[0\] .*odd': columns \['a', 'q'\] match no"):
        prepare_train_corpus(corpus_cfg([{"path": str(tmp_path / "odd"), "weight": 1.0}], n=1), tmp_path / "odd_c")
    # the hub unreachable and nothing cached: the dataset, the fix, one line, no output
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty" / "datasets")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty" / "hub"))
    with pytest.raises(SpecPrefetchError) as err:
        prepare_train_corpus(corpus_cfg(ENTRIES[:1], n=2), tmp_path / "none")
    msg = str(err.value)
    assert msg.startswith(f"train_corpus.hub[0]: cannot load hub dataset '{OV}' (name='sharegpt4v(coco)', "
                          "split='train', revision='main')")
    assert "HF_HUB_OFFLINE=1" in msg and "save_to_disk" in msg and "\n" not in msg
    assert not (tmp_path / "none").exists()


def test_paper_profile_corpus_is_a_hub_instruction_mixture() -> None:
    """config/paper.yaml: real datasets only, none built from the five benchmarks' sources; the embedded default
    and the smoke profile keep their synthetic corpus."""
    cfg = load_config(REPO_ROOT / "config/paper.yaml")
    tc = cfg["train_corpus"]
    assert "mixture" not in tc and (tc["seed"], tc["n_samples"]) == (101, 200000)
    assert hc.hub_keys(tc["hub"]) and all(e["path"] in (OV, CAULDRON, ULTRACHAT) for e in tc["hub"])
    names = " ".join(str(e.get("name", "")).lower() for e in tc["hub"])
    for banned in ("chartqa", "ocrbench", "gsm8k", "humaneval", "hallusion", "iiit5k", "hme100k", "sroie", "st_vqa",
                   "textcaps", "textocr", "infographic", "ureader", "docvqa", "textvqa"):
        assert banned not in names, banned
    for profile in ("config/config.yaml", "config/smoke.yaml"):
        other = load_config(REPO_ROOT / profile)["train_corpus"]
        assert "hub" not in other and other["mixture"]
