"""The predictors' training corpus from real multimodal instruction datasets on the Hugging Face hub.

``train_corpus.hub`` lists datasets (``path``, ``name``, ``split``, ``revision``, ``weight``); each is loaded with
``datasets.load_dataset(path, name, split=..., revision=...)`` and its records are mapped to ``Draft`` s by one
function per schema:

- ``llava``: LLaVA's conversation format, as lmms-lab publishes LLaVA-OneVision-Data (one config per subset) and
  LLaVA-NeXT-Data: ``id``, ``image`` (one image or null), ``conversations: [{from: human|gpt, value}]``,
  ``data_source``. The ``<image>`` placeholder in the user turn is removed (the model code inserts its own).
- ``cauldron``: HuggingFaceM4/the_cauldron (one config per source dataset): ``images`` (a list),
  ``texts: [{user, assistant, source}]``.
- ``messages``: chat-template records (e.g. HuggingFaceH4/ultrachat_200k): ``messages: [{role, content}]``, with
  ``content`` a string or a list of ``{type: text, text}`` parts, and optional ``image``/``images``.

A record becomes one sample: the first user turn (``turns: first``) or the whole dialogue up to the last user turn
(``turns: all``) as the prompt, the answer to it as the reference, and the record's image (records with more than
one image are skipped: a workload sample holds one). Which records: the first ``n`` usable ones of a seeded
permutation of the split (``streaming: false``, the default), or of a seeded ``shuffle(buffer_size=...)`` of the
stream (``streaming: true``), so the same seed gives the same corpus. Provenance records per dataset the path,
config, split, revision (and the resolved commit where the cache names it), the fingerprint and the record indices.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specprefetch.data.draft import Draft, seeded_order
from specprefetch.data.hub import schema_of, strip_image_placeholders, to_rgb_image
from specprefetch.io import SpecPrefetchError

log = logging.getLogger(__name__)

CORPUS_FORMATS = ("llava", "cauldron", "messages")
# Known hub ids -> schema; other paths (mirrors, local copies) are recognised by their columns.
KNOWN_CORPUS_PATHS = {
    "lmms-lab/llava-onevision-data": "llava",
    "lmms-lab/llava-next-data": "llava",
    "huggingfacem4/the_cauldron": "cauldron",
    "huggingfaceh4/ultrachat_200k": "messages",
}
FORMAT_COLUMNS = {"llava": {"conversations"}, "cauldron": {"texts"}, "messages": {"messages"}}
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "bot", "model"}
_COMMIT = re.compile(r"[/\\]([0-9a-f]{40})[/\\]")


class Skip(Exception):  # noqa: N818 - control flow, not an error
    """A record that yields no sample; ``reason`` is one of no_dialogue, multi_image, excluded_source."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def source_key(entry: dict[str, Any]) -> str:
    """The mixture key of a hub entry: ``hub:<path>[:<name>]:<split>`` (unique per entry)."""
    name = f":{entry['name']}" if entry.get("name") else ""
    return f"hub:{entry['path']}{name}:{entry.get('split', 'train')}"


def hub_keys(entries: list[dict[str, Any]]) -> list[str]:
    """Mixture keys of ``train_corpus.hub``; two entries for the same dataset split are refused."""
    keys = [source_key(e) for e in entries]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise SpecPrefetchError(f"invalid config key 'train_corpus.hub': {dup[0]!r} is listed twice (one entry per "
                                "dataset config and split; set its weight instead)")
    return keys


# ------------------------------------------------------------------------------------------ schema detection
def detect_corpus_format(entry: dict[str, Any], columns: list[str] | set[str], where: str) -> str:
    """The schema of a corpus dataset: ``format`` if set, else by known hub id, else by columns."""
    fmt = entry.get("format", "auto")
    if fmt != "auto":
        return fmt
    found = schema_of(str(entry["path"]), columns, KNOWN_CORPUS_PATHS, FORMAT_COLUMNS)
    if found:
        return found
    cols = set(columns)
    raise SpecPrefetchError(
        f"{where} {entry['path']!r}: columns {sorted(cols)} match no supported corpus schema (llava: conversations "
        "[{from, value}] + image; cauldron: texts [{user, assistant}] + images; messages: messages [{role, content}]);"
        " set `format:` if the columns are renamed")


# ------------------------------------------------------------------------------------------ mappings
def _clean(text: Any) -> str:
    return strip_image_placeholders(str(text or "")).strip()


def _dialogue(pairs: list[tuple[str, str]], turns: str) -> tuple[str, str]:
    """(prompt, reference) of a list of (user, assistant) pairs; empty turns are skipped."""
    pairs = [(u, a) for u, a in pairs if u and a]
    if not pairs:
        raise Skip("no_dialogue")
    if turns == "first" or len(pairs) == 1:
        return pairs[0]
    lines = []
    for u, a in pairs[:-1]:
        lines += [f"User: {u}", f"Assistant: {a}"]
    lines.append(f"User: {pairs[-1][0]}")
    return "\n\n".join(lines), pairs[-1][1]


def _pairs_by_role(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pair each user turn with the assistant turn that follows it (system turns and stray answers dropped)."""
    pairs: list[tuple[str, str]] = []
    user: str | None = None
    for role, text in turns:
        role = role.lower()
        if role in USER_ROLES:
            user = text if user is None else f"{user}\n{text}"
        elif role in ASSISTANT_ROLES and user is not None:
            pairs.append((user, text))
            user = None
    return pairs


def _one_image(value: Any, where: str) -> Any:
    """The single image of a record (a cell or a list of cells); several images -> Skip."""
    if isinstance(value, (list, tuple)):
        value = [v for v in value if v is not None]
        if len(value) > 1:
            raise Skip("multi_image")
        value = value[0] if value else None
    return to_rgb_image(value, where)


def _excluded(sources: set[str], exclude: set[str]) -> None:
    if any(s and s.lower() in exclude for s in sources):
        raise Skip("excluded_source")


def map_llava(rec: dict[str, Any], turns: str, exclude: set[str], where: str) -> Draft:
    """LLaVA conversations: ``[{from: human|gpt, value}]``, the ``<image>`` token stripped from the user turn."""
    _excluded({str(rec.get("data_source") or "")}, exclude)
    conv = rec["conversations"] or []
    pairs = _pairs_by_role([(str(t.get("from", "")), _clean(t.get("value"))) for t in conv])
    prompt, reference = _dialogue(pairs, turns)
    meta = {"id": str(rec.get("id") or ""), "data_source": str(rec.get("data_source") or "")}
    return Draft(prompt=prompt, reference=reference, meta=meta, image=_one_image(rec.get("image"), where))


def map_cauldron(rec: dict[str, Any], turns: str, exclude: set[str], where: str) -> Draft:
    """the_cauldron: ``texts: [{user, assistant, source}]`` and ``images: [image, ...]``."""
    texts = rec["texts"] or []
    _excluded({str(t.get("source") or "") for t in texts}, exclude)
    prompt, reference = _dialogue([(_clean(t.get("user")), _clean(t.get("assistant"))) for t in texts], turns)
    meta = {"data_source": str(texts[0].get("source") or "") if texts else ""}
    return Draft(prompt=prompt, reference=reference, meta=meta, image=_one_image(rec.get("images"), where))


def _content_text(content: Any) -> str:
    if isinstance(content, (list, tuple)):  # [{type: text, text}, {type: image}, ...]
        return "\n".join(_clean(p.get("text")) for p in content if isinstance(p, dict) and p.get("text"))
    return _clean(content)


def map_messages(rec: dict[str, Any], turns: str, exclude: set[str], where: str) -> Draft:
    """Chat-template messages ``[{role, content}]`` (content a string or text parts), optional image(s)."""
    _excluded({str(rec.get("data_source") or rec.get("source") or "")}, exclude)
    pairs = _pairs_by_role([(str(m.get("role", "")), _content_text(m.get("content"))) for m in rec["messages"] or []])
    prompt, reference = _dialogue(pairs, turns)
    image = rec.get("images") if rec.get("images") is not None else rec.get("image")
    meta = {"id": str(rec.get("prompt_id") or rec.get("id") or "")}
    return Draft(prompt=prompt, reference=reference, meta=meta, image=_one_image(image, where))


CORPUS_MAPPERS: dict[str, Callable[[dict[str, Any], str, set[str], str], Draft]] = {
    "llava": map_llava, "cauldron": map_cauldron, "messages": map_messages,
}


# ------------------------------------------------------------------------------------------ loading
def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def offline_help() -> str:
    return ("To use a local copy: (1) load it once with datasets.load_dataset(...) into the same HF_HOME on a machine "
            "with network and run with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 (offline, datasets reads only that "
            "processed cache, HF_HOME/datasets/); or (2) `hf download --repo-type dataset <path> --local-dir DIR` and "
            "set the entry's `path: DIR` (name/split as on the hub); or (3) `path:` a Dataset.save_to_disk directory, "
            "or `path: parquet` with `data_files:`")


def load_corpus_dataset(entry: dict[str, Any], where: str, seed: int) -> Any:
    """The entry's split: a map-style Dataset, or (``streaming: true``) a seeded-shuffled IterableDataset."""
    import datasets

    path, name, split, revision = entry["path"], entry.get("name"), entry["split"], entry.get("revision")
    desc = f"{path!r} (name={name!r}, split={split!r}, revision={revision!r})"
    log.info("corpus: loading hub dataset %s", desc)
    local = Path(str(path))
    try:
        if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
            return ds.to_iterable_dataset().shuffle(seed=seed, buffer_size=entry["shuffle_buffer"]) \
                if entry.get("streaming") else ds
        kwargs: dict[str, Any] = {"split": split, "revision": revision}
        if entry.get("data_files"):
            kwargs["data_files"] = entry["data_files"]
        if entry.get("streaming"):
            ds = datasets.load_dataset(path, name, streaming=True, **kwargs)
            return ds.shuffle(seed=seed, buffer_size=int(entry["shuffle_buffer"]))
        return datasets.load_dataset(path, name, **kwargs)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise SpecPrefetchError(
            f"{where}: cannot load hub dataset {desc}: {type(exc).__name__}: {_one_line(exc)}. The Hugging Face hub "
            f"may be unreachable. {offline_help()}") from None


def resolved_commit(ds: Any) -> str | None:
    """The commit the processed cache was built from (its directory name), where the dataset has cache files."""
    for f in getattr(ds, "cache_files", None) or []:
        m = _COMMIT.search(str(f.get("filename", "")))
        if m:
            return m.group(1)
    return None


@dataclass
class HubSource:
    """One ``train_corpus.hub`` entry, read lazily: drafts come in the entry's seeded order, as many as asked."""

    entry: dict[str, Any]
    where: str
    seed: int
    drafts: list[tuple[Draft, str]] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    exhausted: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    spill: Path | None = None  # where each image's PNG goes (a file per image), instead of memory
    _records: Iterator[tuple[int, dict[str, Any]]] | None = None
    _mapper: Callable[..., Draft] | None = None

    def _open(self) -> None:
        ds = load_corpus_dataset(self.entry, self.where, self.seed)
        streaming = bool(self.entry.get("streaming"))
        records: Iterator[dict[str, Any]] | None = None
        columns = list(getattr(ds, "column_names", None) or [])
        if not columns and streaming:  # a stream without declared features: read the columns off its first record
            records = iter(ds)
            first = next(records, None)
            columns = list(first or {})
            records = itertools.chain([] if first is None else [first], records)
        fmt = detect_corpus_format(self.entry, columns, self.where)
        if not FORMAT_COLUMNS[fmt] <= set(columns):
            raise SpecPrefetchError(f"{self.where} {self.entry['path']!r}: format {fmt!r} needs column(s) "
                                    f"{sorted(FORMAT_COLUMNS[fmt])}; the dataset has {sorted(columns)}")
        self._mapper = CORPUS_MAPPERS[fmt]
        self.info = {"path": self.entry["path"], "name": self.entry.get("name"), "split": self.entry["split"],
                     "revision": self.entry.get("revision"), "format": fmt, "turns": self.entry["turns"],
                     "streaming": streaming, "seed": self.seed,
                     "fingerprint": getattr(ds, "_fingerprint", None), "resolved_commit": resolved_commit(ds)}
        if streaming:
            self.info["shuffle_buffer"] = int(self.entry["shuffle_buffer"])
            self._records = enumerate(records if records is not None else iter(ds))  # positions in the shuffle
        else:
            self.info["n_records"] = len(ds)
            self._records = ((i, ds[i]) for i in seeded_order(len(ds), None, self.seed))

    def take(self, n: int) -> list[tuple[Draft, str]]:
        """The first ``n`` usable drafts (fewer if the split runs out; then ``exhausted`` is set)."""
        from specprefetch.data.imaging import png_bytes

        if self._records is None and not self.exhausted:
            self._open()
        e = self.entry
        exclude = {s.lower() for s in e.get("exclude_data_sources") or []}
        label = f"hub {e['path']}" + (f" name={e['name']}" if e.get("name") else "") + \
            f" split={e['split']} revision={e.get('revision')}"
        pos = "position" if e.get("streaming") else "index"
        while len(self.drafts) < n and not self.exhausted:
            try:
                i, rec = next(self._records)  # type: ignore[arg-type]
            except StopIteration:
                self.exhausted = True
                break
            try:
                d = self._mapper(rec, e["turns"], exclude, f"{self.where} record {i}")  # type: ignore[misc]
            except Skip as why:
                self.skipped[why.reason] = self.skipped.get(why.reason, 0) + 1
                continue
            except KeyError as exc:
                raise SpecPrefetchError(f"{self.where} {e['path']!r}: record {i} lacks column {exc}") from None
            meta = {**d.meta, "dataset": e["path"], "config": e.get("name"), pos: i}
            image = None if d.image is None else png_bytes(d.image)  # the bytes assemble() would write; PIL freed
            if image is not None and self.spill is not None:
                path = self.spill / f"{self.seed}-{i}.png"
                path.write_bytes(image)
                image = path
            self.drafts.append((Draft(prompt=d.prompt, reference=d.reference, meta=meta, image=image),
                                f"{label} {pos}={i}"))
            self.indices.append(i)
        return self.drafts[:n]

    def provenance(self, n: int) -> dict[str, Any]:
        return {**self.info, "n_taken": n, "skipped": dict(sorted(self.skipped.items())),
                ("positions" if self.entry.get("streaming") else "indices"): self.indices[:n]}


def hub_corpus_drafts(entries: list[dict[str, Any]], counts: dict[str, int], seeds: dict[str, int],
                      spill: Path | None = None) -> tuple[dict[str, list[tuple[Draft, str]]], list[dict[str, Any]]]:
    """Drafts of each hub entry (``counts`` by :func:`source_key`), with a shortfall moved to the other entries.

    An entry whose split has fewer usable records than its share gives all it has; the difference is split over
    the entries that still have records, by their weights, until the total is met. Returns the drafts per key and
    each entry's provenance. With ``spill``, each image's PNG is a file there (the draft holds its path), so memory
    does not grow with the corpus's images.
    """
    from specprefetch.config import section_defaults

    keys = hub_keys(entries)
    entries = [section_defaults("corpus_dataset", e) for e in entries]  # as validated configs have them
    if spill is not None:
        spill.mkdir(parents=True, exist_ok=True)
    sources = {k: HubSource(e, f"train_corpus.hub[{i}]", seeds[k], spill=spill)
               for i, (k, e) in enumerate(zip(keys, entries))}
    want = {k: int(counts.get(k, 0)) for k in keys}
    total = sum(want.values())
    while True:
        for k in keys:
            if want[k]:
                sources[k].take(want[k])
        have = {k: len(sources[k].drafts[: want[k]]) for k in keys}
        short = total - sum(have.values())
        if short <= 0:
            break
        open_ = {k: float(entries[i]["weight"]) for i, k in enumerate(keys) if not sources[k].exhausted}
        if not open_:
            raise SpecPrefetchError(f"train_corpus.hub: the datasets hold {sum(have.values())} usable records, "
                                    f"{total} wanted; lower train_corpus.n_samples or add datasets")
        for k in keys:
            if sources[k].exhausted and have[k] < want[k]:
                log.warning("corpus: %s has %d usable records (wanted %d); the other datasets make up the "
                            "difference", k, have[k], want[k])
                want[k] = have[k]
        for k, extra in largest_remainder(open_, short).items():
            want[k] += extra
    parts = {k: sources[k].drafts[: want[k]] for k in keys if want[k]}
    prov = [sources[k].provenance(want[k]) if want[k] else {**entries[i], "n_taken": 0}
            for i, k in enumerate(keys)]
    return parts, prov


def largest_remainder(weights: dict[str, float], n: int) -> dict[str, int]:
    """n split by weights (largest remainder, ties by key), as corpus.mixture_counts (which imports this module)."""
    total = sum(weights.values())
    exact = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(weights, key=lambda k: (-(exact[k] - counts[k]), k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts
