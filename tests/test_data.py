"""Workloads, corpus, tokenizer and lm-eval tasks: determinism, exact answers, format errors, disjointness."""

from __future__ import annotations

import copy
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
from PIL import Image

from specprefetch.config import load_config
from specprefetch.data import hub
from specprefetch.data.corpus import (
    DisjointnessError,
    check_disjoint,
    derived_seed,
    mixture_counts,
    prepare_train_corpus,
)
from specprefetch.data.generators import GENERATORS, IMAGE_GENERATORS
from specprefetch.data.imaging import png_bytes
from specprefetch.data.synth_gsm8k import verify_gsm8k_solution
from specprefetch.data.workloads import (
    Sample,
    WorkloadError,
    prepare_workload,
    read_samples_jsonl,
    read_workload,
    write_workload,
)
from specprefetch.io import SpecPrefetchError

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["gsm8k", "humaneval", "ocrbench", "chartqa", "hallusionbench"]
VLM = ["ocrbench", "chartqa", "hallusionbench"]


@pytest.fixture(scope="module")
def smoke() -> dict:
    return load_config(ROOT / "config/smoke.yaml")


@pytest.fixture(scope="module")
def built(smoke: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke profile's five workloads and corpus, built once for the module."""
    root = tmp_path_factory.mktemp("data")
    for name in WORKLOADS:
        prepare_workload(smoke, name, root / "workloads" / name)
    prepare_train_corpus(smoke, root / "corpus")
    return root


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != "manifest.json" and "lm_eval" not in p.parts}


# ------------------------------------------------------------------------------------------ determinism
@pytest.mark.parametrize("generator", sorted(GENERATORS))
def test_generator_same_seed_same_bytes_other_seed_differs(generator: str) -> None:
    fn = GENERATORS[generator]

    def encode(seed: int) -> list[tuple[str, str, bytes | None]]:
        out = []
        for i in range(3):
            d = fn(seed, i, 112)
            out.append((d.prompt, d.reference, None if d.image is None else png_bytes(d.image)))
        return out

    a, b, c = encode(5), encode(5), encode(6)
    assert a == b
    assert a != c
    if generator in IMAGE_GENERATORS:
        assert all(x[2] != y[2] for x, y in zip(a, c))


@pytest.mark.parametrize("name", WORKLOADS)
def test_prepare_workload_is_byte_identical(smoke: dict, built: Path, tmp_path: Path, name: str) -> None:
    again = tmp_path / name
    prepare_workload(smoke, name, again)
    assert _files(again) == _files(built / "workloads" / name)
    other = copy.deepcopy(smoke)
    other["workloads"][name]["seed"] += 1
    prepare_workload(other, name, tmp_path / "other")
    assert (tmp_path / "other/samples.jsonl").read_bytes() != (again / "samples.jsonl").read_bytes()


def test_workload_contract(smoke: dict, built: Path) -> None:
    size = smoke["image"]["size"]
    for name in WORKLOADS:
        root = built / "workloads" / name
        samples = read_workload(root)
        manifest = json.loads((root / "manifest.json").read_text())
        assert manifest["format"] == "specprefetch-workload/1" and manifest["n_samples"] == len(samples) == 4
        assert [s.id for s in samples] == [f"{name}-{i:05d}" for i in range(4)]
        for s in samples:
            assert s.benchmark == name and s.split == "test" and s.source
            if name in VLM:
                with Image.open(s.image_path(root)) as img:
                    assert img.format == "PNG" and img.mode == "RGB" and img.size == (size, size)
                assert "<image>" not in s.prompt and "<|image_pad|>" not in s.prompt
            else:
                assert s.image is None and s.image_path(root) is None


# ------------------------------------------------------------------------------------------ exact answers
def _eval_arith(expr: str) -> Fraction:
    """Independent evaluator for the test: digits, . + - * / and parentheses only."""
    assert re.fullmatch(r"[0-9.+\-*/() ]+", expr), expr
    tokens = re.findall(r"\d+(?:\.\d+)?|[-+*/()]", expr)
    py = "".join(f"Fraction('{t}')" if t[0].isdigit() else t for t in tokens)
    return eval(py, {"Fraction": Fraction})  # noqa: S307 - validated arithmetic only


def test_gsm8k_annotations_reevaluate_to_the_stated_answer() -> None:
    gen = GENERATORS["gsm8k_synth"]
    templates = set()
    for i in range(150):
        d = gen(11, i, 0)
        templates.add(d.meta["template"])
        anns = re.findall(r"<<([^=<>]+)=([^<>]+)>>([-0-9.]+)", d.reference)
        assert 2 <= len(anns) <= 5, d.reference
        for expr, stated, shown in anns:
            assert _eval_arith(expr) == Fraction(stated) == Fraction(shown), (expr, stated)
        assert d.reference.splitlines()[-1] == f"#### {d.meta['answer']}"
        assert Fraction(anns[-1][1]) == int(d.meta["answer"])  # the last step is the answer
        assert verify_gsm8k_solution(d.reference) == d.meta["answer"]
        assert d.prompt.startswith("Question: ") and d.prompt.endswith("\nAnswer:")
    assert len(templates) >= 10


def test_gsm8k_verifier_rejects_a_wrong_annotation() -> None:
    with pytest.raises(SpecPrefetchError, match="48/2"):
        verify_gsm8k_solution("She sold 48/2 = <<48/2=25>>25 clips.\n#### 25")


def _chart_expected(meta: dict, question: str) -> str:
    """Recompute a chart answer from the chart data by parsing the question (independently of the generator)."""
    cats, series, dec = meta["categories"], meta["series"], meta["decimals"]

    def f(v):
        return f"{v:.{dec}f}" if dec else str(int(round(v)))

    if meta["chart_type"] == "grouped_bar":
        by_name = {s["name"]: s["values"] for s in series}
        cat = next((c for c in cats if f"in {c}?" in question or question.startswith(f"In {c},")), None)
        i = cats.index(cat) if cat else None
        if question.startswith("What is the value for"):
            name = question[len("What is the value for "):].split(" in ")[0]
            return f(by_name[name][i])
        if question.startswith("For "):
            name = question[4:].split(",")[0]
            return cats[max(range(len(cats)), key=lambda k: by_name[name][k])]
        a, b = series[0], series[1]
        if question.startswith("In "):
            return "Yes" if a["values"][i] > b["values"][i] else "No"
        return f(abs(a["values"][i] - b["values"][i]))
    vals = series[0]["values"]
    named = sorted((c for c in cats if re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", question)),
                   key=question.index)
    qt = meta["question_type"]
    if qt == "value":
        return f(vals[cats.index(named[0])])
    if qt == "argmax":
        return cats[vals.index(max(vals))]
    if qt == "argmin":
        return cats[vals.index(min(vals))]
    if qt == "difference":
        if "highest and the lowest" in question:
            return f(max(vals) - min(vals))
        return f(abs(vals[cats.index(named[0])] - vals[cats.index(named[1])]))
    if qt == "sum":
        return f(vals[cats.index(named[0])] + vals[cats.index(named[1])])
    if qt == "average":
        return f"{round(sum(vals) / len(vals), 2):.2f}".rstrip("0").rstrip(".")
    if qt == "ratio":
        return f"{round(vals[cats.index(named[0])] / vals[cats.index(named[1])], 2):.2f}".rstrip("0").rstrip(".")
    if qt == "count":
        t = float(re.search(r"greater than ([0-9.]+)\?", question).group(1))
        return str(sum(v > t for v in vals))
    if qt == "compare":
        return "Yes" if vals[cats.index(named[0])] > vals[cats.index(named[1])] else "No"
    raise AssertionError(qt)


def test_chart_answers_match_the_chart_data() -> None:
    gen = GENERATORS["chartqa_synth"]
    kinds, qtypes = set(), set()
    for i in range(40):
        d = gen(14, i, 112)
        m = d.meta
        kinds.add(m["chart_type"])
        qtypes.add(m["question_type"])
        question = d.prompt.splitlines()[0]
        assert d.reference == m["answer"] == _chart_expected(m, question), (i, question, m)
        if m["chart_type"] == "pie":
            assert sum(m["series"][0]["values"]) == 100
    assert kinds == {"bar", "hbar", "grouped_bar", "line", "pie"}
    assert len(qtypes) >= 7


def test_hallusion_is_balanced_and_false_premises_answer_no() -> None:
    gen = GENERATORS["hallusion_synth"]
    drafts = [gen(15, i, 112) for i in range(40)]
    answers = [d.reference for d in drafts]
    assert answers.count("Yes") == answers.count("No") == 20
    assert all(d.prompt.endswith("Please answer yes or no.") for d in drafts)
    assert all(d.reference == "No" for d in drafts if d.meta["false_premise"])
    assert any(d.meta["false_premise"] for d in drafts)
    assert len({d.meta["question_type"] for d in drafts}) >= 6


def test_ocr_samples_cover_the_benchmark_question_types() -> None:
    gen = GENERATORS["ocr_synth"]
    drafts = [gen(13, i, 112) for i in range(40)]
    assert len({d.meta["question_type"] for d in drafts}) >= 6
    for d in drafts:
        assert d.reference and d.reference == d.meta["answer"] and d.image.size == (112, 112)


def test_every_bundled_font_draws_ascii() -> None:
    """A font without the glyphs (e.g. a symbol-only TTF) would silently give an image with no text."""
    import string

    import numpy as np
    from PIL import ImageDraw

    from specprefetch.data.imaging import FONT_ALNUM_ONLY, FONTS, load_font

    for name in sorted({f for files in FONTS.values() for f in files}):
        chars = string.ascii_letters + string.digits + ("" if name in FONT_ALNUM_ONLY else "$.-,:/%")
        font = load_font(name, 24)
        for ch in chars:
            img = Image.new("L", (48, 48), 0)
            ImageDraw.Draw(img).text((8, 8), ch, font=font, fill=255)
            assert np.asarray(img).max() > 0, (name, ch)


def test_humaneval_is_the_real_problems_in_seeded_order(smoke: dict, built: Path) -> None:
    from specprefetch.data.humaneval import humaneval_drafts, load_problems

    problems = load_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    samples = read_workload(built / "workloads" / "humaneval")
    by_id = {p["task_id"]: p for p in problems}
    for s in samples:
        p = by_id[s.meta["task_id"]]
        assert s.prompt == p["prompt"] and s.reference == p["canonical_solution"]
        assert s.meta["test"] == p["test"] and s.meta["entry_point"] == p["entry_point"]
    all_drafts, _ = humaneval_drafts(1000, 12)
    assert len(all_drafts) == 164
    assert [d.meta["task_id"] for d in all_drafts[:4]] == [s.meta["task_id"] for s in samples]


# ------------------------------------------------------------------------------------------ format errors
def _tiny_workload(tmp_path: Path) -> Path:
    img = png_bytes(Image.new("RGB", (8, 8), (255, 0, 0)))
    samples = [Sample(id=f"t-{i}", benchmark="t", prompt=f"q{i}", reference=f"a{i}",
                      image="images/00000.png" if i == 0 else None, split="test", source="test") for i in range(3)]
    return write_workload(tmp_path / "w", samples, {"images/00000.png": img}, "test", 0, {})


def test_bad_line_is_reported_with_file_and_line_number(tmp_path: Path) -> None:
    root = _tiny_workload(tmp_path)
    assert len(read_workload(root)) == 3
    path = root / "samples.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], '{"id": "t-2", "prompt": '] ) + "\n")
    with pytest.raises(WorkloadError, match="does not match manifest"):
        read_workload(root)  # the sha256 check catches any edit first
    with pytest.raises(WorkloadError, match=r"samples\.jsonl:3: not valid JSON"):
        read_workload(root, verify=False)
    bad = json.loads(lines[1])
    del bad["reference"]
    path.write_text("\n".join([lines[0], json.dumps(bad), lines[2]]) + "\n")
    with pytest.raises(WorkloadError, match=r"samples\.jsonl:2: missing key\(s\) reference"):
        read_workload(root, verify=False)
    bad = json.loads(lines[1]) | {"split": "dev"}
    path.write_text("\n".join([lines[0], json.dumps(bad), lines[2]]) + "\n")
    with pytest.raises(WorkloadError, match=r":2: key 'split'"):
        read_samples_jsonl(path)


def test_missing_image_is_named(tmp_path: Path) -> None:
    root = _tiny_workload(tmp_path)
    (root / "images/00000.png").unlink()
    with pytest.raises(WorkloadError, match=r"samples\.jsonl:1: image file not found: .*00000\.png"):
        read_workload(root)


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    s = Sample(id="x", benchmark="t", prompt="q", reference="a", image="images/1.png", split="test", source="s")
    with pytest.raises(WorkloadError, match="has no bytes"):
        write_workload(tmp_path / "w", [s], {}, "test", 0, {})
    assert not (tmp_path / "w").exists() and not list(tmp_path.iterdir())


def test_local_generator_reads_a_user_jsonl(smoke: dict, tmp_path: Path) -> None:
    user = tmp_path / "user"
    (user / "pics").mkdir(parents=True)
    Image.new("RGBA", (20, 10), (0, 128, 255, 100)).save(user / "pics/a.png")
    rows = [{"id": "u1", "benchmark": "mine", "prompt": "What colour?", "reference": "blue",
             "image": "pics/a.png", "split": "test", "source": "hand-made", "meta": {"answer": "blue"}},
            {"id": "u2", "benchmark": "mine", "prompt": "2+2?", "reference": "4", "image": None,
             "split": "test", "source": "hand-made"}]
    (user / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = copy.deepcopy(smoke)
    cfg["workloads"]["mine"] = {"category": "VLM", "display_name": "Mine", "generator": "local",
                                "path": str(user / "s.jsonl"), "seed": 1, "lm_eval_task": "specprefetch_mine"}
    prepare_workload(cfg, "mine", tmp_path / "out")
    samples = read_workload(tmp_path / "out")
    assert [s.id for s in samples] == ["u1", "u2"] and samples[0].image == "images/00000.png"
    with Image.open(samples[0].image_path(tmp_path / "out")) as img:
        assert img.mode == "RGB" and img.size == (20, 10)
    assert (tmp_path / "out/lm_eval/specprefetch_mine.yaml").is_file()
    (user / "s.jsonl").write_text(json.dumps(rows[0]) + "\nnot json\n")
    with pytest.raises(WorkloadError, match=r"s\.jsonl:2"):
        prepare_workload(cfg, "mine", tmp_path / "out2")


# ------------------------------------------------------------------------------------------ corpus
def test_mixture_counts_and_derived_seeds() -> None:
    counts = mixture_counts({"gsm8k_synth": 0.2, "ocr_synth": 0.15, "chartqa_synth": 0.15,
                             "hallusion_synth": 0.15, "stdlib_code": 0.2, "stdlib_docs": 0.15}, 24)
    assert sum(counts.values()) == 24 and counts["gsm8k_synth"] >= 4
    s = derived_seed(101, "ocr_synth", set())
    assert derived_seed(101, "ocr_synth", {s}) != s


def test_corpus_is_disjoint_and_overlap_is_caught(smoke: dict, built: Path, tmp_path: Path) -> None:
    corpus = read_workload(built / "corpus")
    assert len(corpus) == smoke["train_corpus"]["n_samples"]
    assert {s.split for s in corpus} == {"train"} and {s.benchmark for s in corpus} == {"corpus"}
    assert any(s.image for s in corpus) and any(s.source.startswith("stdlib ") for s in corpus)
    workloads = [built / "workloads" / n for n in WORKLOADS]
    report = check_disjoint(built / "corpus", workloads)
    assert report["overlaps"] == 0 and set(report["workloads"]) == set(WORKLOADS)
    # Plant one evaluation sample (with its image) in a copy of the corpus: the check must fail.
    leak = read_workload(built / "workloads" / "chartqa")[1]
    samples = corpus[:3] + [Sample(**{**leak.__dict__, "id": "corpus-leak", "benchmark": "corpus",
                                      "split": "train", "image": "images/leak.png"})]
    images = {s.image: s.image_path(built / "corpus").read_bytes() for s in corpus[:3] if s.image}
    images["images/leak.png"] = leak.image_path(built / "workloads" / "chartqa").read_bytes()
    write_workload(tmp_path / "leaky", samples, images, "corpus", 0, {}, name="corpus")
    with pytest.raises(DisjointnessError, match=r"corpus sample corpus-leak = chartqa/chartqa-00001"):
        check_disjoint(tmp_path / "leaky", workloads)


def test_default_profile_corpus_text_and_images_are_disjoint_from_workloads() -> None:
    """The embedded default: every text-only corpus sample vs every text-only evaluation sample (prompt and
    prompt+reference hashes), and image hashes of each image generator's corpus stream vs its workload."""
    from specprefetch.data.corpus import _hash_text, _workload_seeds
    from specprefetch.data.humaneval import humaneval_drafts
    from specprefetch.data.stdlib import stdlib_drafts

    cfg = load_config(ROOT / "config/config.yaml")
    tc = cfg["train_corpus"]
    counts = mixture_counts(tc["mixture"], tc["n_samples"])
    eval_text = set()
    for w in cfg["workloads"].values():
        if w["generator"] == "gsm8k_synth":
            drafts = [GENERATORS["gsm8k_synth"](w["seed"], i, 0) for i in range(w["n_samples"])]
        elif w["generator"] == "humaneval":
            drafts = humaneval_drafts(w["n_samples"], w["seed"])[0]
        else:
            continue
        eval_text |= {_hash_text(d.prompt) for d in drafts} | {_hash_text(d.prompt, d.reference) for d in drafts}
    corpus_text = []
    for source in ("stdlib_code", "stdlib_docs"):
        corpus_text += stdlib_drafts(source, counts[source], derived_seed(tc["seed"], source, set()))
    g_seed = derived_seed(tc["seed"], "gsm8k_synth", _workload_seeds(cfg, "gsm8k_synth"))
    corpus_text += [GENERATORS["gsm8k_synth"](g_seed, i, 0) for i in range(counts["gsm8k_synth"])]
    assert len(corpus_text) == counts["stdlib_code"] + counts["stdlib_docs"] + counts["gsm8k_synth"]
    for d in corpus_text:
        assert _hash_text(d.prompt) not in eval_text and _hash_text(d.prompt, d.reference) not in eval_text
    size = cfg["image"]["size"]
    for gen in IMAGE_GENERATORS:
        w_seeds = _workload_seeds(cfg, gen)
        c_seed = derived_seed(tc["seed"], gen, w_seeds)
        assert c_seed not in w_seeds
        ws = next(iter(w_seeds))
        w_imgs = {png_bytes(GENERATORS[gen](ws, i, size).image) for i in range(6)}
        c_imgs = {png_bytes(GENERATORS[gen](c_seed, i, size).image) for i in range(6)}
        assert len(w_imgs) == len(c_imgs) == 6 and not w_imgs & c_imgs


def test_stdlib_code_excludes_humaneval_overlap() -> None:
    from specprefetch.data.humaneval import load_problems
    from specprefetch.data.stdlib import humaneval_fingerprint, overlaps_humaneval, stdlib_drafts, stdlib_files

    assert not any("/test/" in f"/{f}" or f.startswith("test/") for f in stdlib_files())
    names, _ = humaneval_fingerprint()
    drafts = stdlib_drafts("stdlib_code", 60, 3)
    assert len(drafts) == 60
    for d in drafts:
        assert d.meta["qualname"].split(".")[-1] not in names
        assert not overlaps_humaneval(d.prompt + d.reference)
        assert d.prompt.lstrip().startswith(("def ", "async def ", "@"))
    p = load_problems()[0]
    assert overlaps_humaneval(p["prompt"] + p["canonical_solution"])


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_special_tokens_round_trip_and_determinism(smoke: dict, built: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from specprefetch.data.tokenizer import SPECIAL_TOKENS, train_tokenizer

    train_tokenizer(smoke, built / "corpus", tmp_path / "a")
    train_tokenizer(smoke, built / "corpus", tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert len(tok) <= smoke["tokenizer"]["vocab_size"]
    text = ("def f(x):\n    return x ** 2  # héllo, 世界 😀\n<|im_start|>user\n"
            "<|vision_start|><|image_pad|><|vision_end|><image>")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_refuses_an_evaluation_workload(smoke: dict, built: Path, tmp_path: Path) -> None:
    from specprefetch.data.tokenizer import train_tokenizer

    with pytest.raises(SpecPrefetchError, match="split 'train'"):
        train_tokenizer(smoke, built / "workloads" / "gsm8k", tmp_path / "tok")


# ------------------------------------------------------------------------------------------ lm-eval
def test_lm_eval_task_loads_offline_and_shows_our_prompts(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specprefetch.data.lm_eval_tasks import load_lm_eval_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in ("gsm8k", "chartqa"):
        root = built / "workloads" / name
        task = load_lm_eval_task(root, f"specprefetch_{name}")
        docs = list(task.test_docs())
        samples = read_workload(root)
        assert len(docs) == len(samples)
        for doc, s in zip(docs, samples):
            assert task.doc_to_text(doc) == s.prompt
            assert task.doc_to_target(doc) == s.reference


# ------------------------------------------------------------------------------------------ hub
def test_hub_mappings_on_hand_made_records() -> None:
    img = Image.new("L", (30, 20), 128)
    g = hub.map_gsm8k({"question": "Tom has 3 apples and buys 2 more. How many?",
                       "answer": "Tom has 3+2 = <<3+2=5>>5 apples.\n#### 5"})
    assert g.prompt == "Question: Tom has 3 apples and buys 2 more. How many?\nAnswer:" and g.meta["answer"] == "5"
    assert verify_gsm8k_solution(g.reference) == "5"
    h = hub.map_humaneval({"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
                           "test": "def check(c): assert c() == 1\n", "entry_point": "f"})
    assert (h.prompt, h.reference, h.meta["entry_point"]) == ("def f():\n", "    return 1\n", "f")
    o = hub.map_ocrbench({"question": "what is written in the image?", "answer": ["EXIT", "exit"],
                          "question_type": "Regular Text Recognition", "dataset": "IIIT5K", "image": img})
    assert o.reference == "EXIT" and o.meta["answers"] == ["EXIT", "exit"] and o.image.mode == "RGB"
    buf = png_bytes(Image.new("RGB", (5, 5)))
    c = hub.map_chartqa({"query": "What is the highest value?", "label": ["42"], "human_or_machine": 0,
                         "image": {"bytes": buf, "path": None}},
                        fmt=lambda rec: f"<image>{rec['query']}\nAnswer briefly.")
    assert c.prompt == "What is the highest value?\nAnswer briefly." and c.reference == "42" and c.image.size == (5, 5)
    yes = hub.map_hallusionbench({"question": "Is the left line longer?", "gt_answer": "1", "category": "VD",
                                  "subcategory": "illusion", "image": img})
    no = hub.map_hallusionbench({"question": "Is it red?", "gt_answer": "0", "image": None})
    assert (yes.reference, no.reference, no.image) == ("Yes", "No", None)
    with pytest.raises(SpecPrefetchError, match="gt_answer"):
        hub.map_hallusionbench({"question": "?", "gt_answer": "maybe"})
    assert hub.detect_format("openai/gsm8k", []) == "gsm8k"
    assert hub.detect_format("my/mirror", ["query", "label", "image", "human_or_machine"]) == "chartqa"
    assert hub.detect_format("my/mirror", ["question", "answer", "image", "question_type"]) == "ocrbench"
    with pytest.raises(SpecPrefetchError, match="match no supported benchmark"):
        hub.detect_format("my/mirror", ["text"])


def test_offline_hub_error_names_the_dataset_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing to fall back on
    cfg = load_config(ROOT / "config/paper.yaml")
    with pytest.raises(SpecPrefetchError) as err:
        prepare_workload(cfg, "gsm8k", tmp_path / "gsm8k")
    msg = str(err.value)
    assert "openai/gsm8k" in msg and "workload 'gsm8k'" in msg
    assert "HF_DATASETS_OFFLINE=1" in msg and "generator: local" in msg
    assert not (tmp_path / "gsm8k").exists()


# ------------------------------------------------------------------------------------------ CLI
def test_cli_prepare_and_check_disjoint(built: Path, tmp_path: Path) -> None:
    from specprefetch.cli import main

    assert main(["prepare-workload", "--config", str(ROOT / "config/smoke.yaml"), "--workload", "gsm8k",
                 "--out", str(tmp_path / "gsm8k")]) == 0
    assert _files(tmp_path / "gsm8k") == _files(built / "workloads" / "gsm8k")
    out = tmp_path / "disjointness.json"
    assert main(["check-disjoint", "--corpus", str(built / "corpus"), "--workloads",
                 *[str(built / "workloads" / n) for n in WORKLOADS], "--out", str(out)]) == 0
    assert json.loads(out.read_text())["overlaps"] == 0
    assert main(["prepare-workload", "--config", str(ROOT / "config/smoke.yaml"), "--workload", "nope",
                 "--out", str(tmp_path / "nope")]) == 2
