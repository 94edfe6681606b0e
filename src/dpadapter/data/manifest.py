"""Every file of a user's image folder decoded once and remembered, so bad data stops a run
before any job and an edited image reruns what read it.

A folder is trusted only after each of its images has been opened and fully decoded: a corrupt
PNG found by the first fine-tuning job costs a traceback in a log and, with the overwrite
switch, finished results. The result of each decode (size, mtime, SHA-256 of the bytes, PIL
mode, or the error) is kept in a manifest under `<data.root>/.cache/manifests/`, keyed by the
file's path, size and mtime, so re-checking an unchanged folder stats its files and decodes
nothing. What the checks refuse, each naming the files and the fix:

- a file in a class folder that is not an image (by extension; hidden files are skipped);
- an image PIL cannot decode (truncated, corrupt, not what its extension says);
- a class folder without images, in any split;
- the same image (by content hash) in two splits (of train, test and the optional validation
  split): a test image seen in training, a validation image seen in training or test.

The manifest's content fingerprint (`Scan.fingerprint`: the hashes by split, class and name,
not where the folder lies nor its mtimes) is what the workflow's rerun triggers read
(`dpadapter.workflow.fingerprint`), so adding, removing or editing an image reruns exactly the
jobs that read it. `file_fingerprint` does the same for the files of any other dataset.

Layer 1 (data); no torch: it runs while the workflow parses.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dpadapter.ground import atomic

# torchvision's ImageFolder extensions
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# PIL modes of one-channel images (anything else is read as colour)
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F", "La"})
FORMAT = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One file as last decoded: its stat key, content hash, PIL mode, or why it failed."""

    size: int
    mtime_ns: int
    sha256: str
    mode: str | None
    error: str | None


@dataclass(frozen=True)
class Scan:
    """A folder's splits as read: `files[split][class]` (sorted names), and what is wrong."""

    base: Path
    folders: dict[str, str]  # split ("train", "test", "val") -> its folder name under base
    files: dict[str, dict[str, list[str]]]
    entries: dict[str, Entry]  # "<folder>/<class>/<name>" -> entry
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def classes(self) -> list[str]:
        return list(self.files.get("train", {}))

    @property
    def channels(self) -> int:
        """1 when every image is grey (PIL modes L, 1, I, ...), else 3 (grey ones replicated)."""
        modes = {e.mode for e in self.entries.values()}
        return 1 if modes and modes <= GREY_MODES else 3

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the content hashes by split, class and name (not of paths or mtimes)."""
        rows = [
            [split, cls, name, self.entries[self.rel(split, cls, name)].sha256]
            for split, classes in sorted(self.files.items())
            for cls, names in classes.items()
            for name in names
        ]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()

    def rel(self, split: str, cls: str, name: str) -> str:
        return f"{self.folders[split]}/{cls}/{name}"


def manifest_file(cache_dir: Path, what: Path) -> Path:
    key = hashlib.sha256(str(what.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', what.name)}-{key}.json"


def _read_cache(path: Path) -> dict[str, Entry]:
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            return {}
        return {k: Entry(*v) for k, v in raw["files"].items()}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def _write_cache(path: Path, entries: dict[str, Entry]) -> None:
    rows = {k: [e.size, e.mtime_ns, e.sha256, e.mode, e.error] for k, e in sorted(entries.items())}
    try:
        atomic.write_text(path, json.dumps({"format": FORMAT, "files": rows}))
    except OSError:
        pass  # a read-only data root: every check decodes again, nothing is wrong


def _decode(path: Path, st: os.stat_result) -> Entry:
    """Read the bytes once: hash them, and decode them fully with PIL."""
    from PIL import Image, UnidentifiedImageError

    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return Entry(st.st_size, st.st_mtime_ns, sha, img.mode, None)
    except Exception as exc:  # PIL raises many kinds for a bad file
        why = "no image format PIL knows" if isinstance(exc, UnidentifiedImageError) else exc
        return Entry(st.st_size, st.st_mtime_ns, sha, None, f"{type(exc).__name__}: {why}")


def _entries(paths: dict[str, Path], cache: Path) -> dict[str, Entry]:
    """Entry of each path: from the manifest while its size and mtime match, else decoded."""
    known = _read_cache(cache)
    out: dict[str, Entry] = {}
    todo: list[tuple[str, Path, os.stat_result]] = []
    for rel, p in paths.items():
        st = p.stat()
        e = known.get(rel)
        if e is not None and (e.size, e.mtime_ns) == (st.st_size, st.st_mtime_ns):
            out[rel] = e
        else:
            todo.append((rel, p, st))
    if todo:
        # PIL decodes and hashlib hashes outside the GIL: threads read several files at once
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for (rel, _, _), e in zip(
                todo, pool.map(lambda t: _decode(t[1], t[2]), todo), strict=True
            ):
                out[rel] = e
    if todo or set(known) != set(out):
        _write_cache(cache, out)
    return out


VAL_NAMES = ("val", "validation")


def _split_folders(base: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """(split -> folder name, problems, notes). Beside `test/`, `val/` or `validation/` is the
    validation split; `val/` without `test/` is the test split's old name (read so, with a
    note), and then only `validation/` can be the validation split."""
    folders, problems, notes = {"train": "train"}, [], []
    test = (base / "test").is_dir()
    vals = [v for v in VAL_NAMES if (base / v).is_dir()]
    if test:
        folders["test"] = "test"
    elif "val" in vals:
        folders["test"] = "val"
        vals.remove("val")
        notes.append(
            f"{base}/val is read as the test split (the old name of test/); rename it to "
            f"{base}/test to say so (val/ beside test/ is the validation split)"
        )
    if len(vals) > 1:
        problems.append(
            f"{base}: both val/ and validation/: one validation split is read; merge them "
            "into one of the two"
        )
    elif vals:
        folders["val"] = vals[0]
    return folders, problems, notes


def _class_files(top: Path) -> dict[str, list[str]]:
    classes = sorted(e.name for e in os.scandir(top) if e.is_dir() and not e.name.startswith("."))
    return {
        c: sorted(e.name for e in os.scandir(top / c) if e.is_file() and not e.name.startswith("."))
        for c in classes
    }


def _listing_problems(base: Path, folders, listing) -> list[str]:
    """Missing or empty folders, non-image files and classes only in the test or validation
    split."""
    out = []
    for split, cls_files in listing.items():
        top = base / folders[split]
        if not cls_files:
            out.append(f"{top} has no class folders (the layout is {top}/<class>/<images>)")
        empty = [c for c, names in cls_files.items() if not names]
        if empty:
            out.append(
                f"{top}: class folders without images: {', '.join(empty[:5])}; put images in "
                "them or remove them (a class without test or validation images needs no folder "
                "there)"
            )
        strays = [
            f"{top}/{c}/{n}"
            for c, names in cls_files.items()
            for n in names
            if not n.lower().endswith(EXTENSIONS)
        ]
        if strays:
            out.append(
                f"{len(strays)} file(s) that are not images ({', '.join(EXTENSIONS)}): "
                f"{', '.join(strays[:5])}; move them out of the class folders"
            )
    for split in ("test", "val"):
        stray = sorted(set(listing.get(split, ())) - set(listing["train"]))
        if stray:
            out.append(
                f"{base / folders[split]}: class folders not in train/: {', '.join(stray[:5])}"
            )
    return out


def _content_problems(scan: Scan) -> list[str]:
    """Images that cannot be decoded, and images in two splits."""
    out = []
    bad = [(r, e.error) for r, e in scan.entries.items() if e.error]
    if bad:
        shown = "\n".join(f"  {scan.base / r}: {err}" for r, err in sorted(bad)[:10])
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        out.append(f"{len(bad)} image(s) cannot be decoded; replace or remove them:\n{shown}{more}")
    seen: dict[str, tuple[str, str]] = {}
    leaks = []
    for split, classes in scan.files.items():
        for cls, names in classes.items():
            for n in names:
                rel = scan.rel(split, cls, n)
                e = scan.entries.get(rel)
                if e is None or e.error:
                    continue
                first = seen.setdefault(e.sha256, (split, rel))
                if first[0] != split:
                    leaks.append(f"  {scan.base / first[1]} = {scan.base / rel}")
    if leaks:
        shown = "\n".join(leaks[:10]) + (
            f"\n  ... and {len(leaks) - 10} more" if len(leaks) > 10 else ""
        )
        out.append(
            f"{len(leaks)} image(s) are in two splits (same content): a test image seen in "
            "training makes the test accuracy a lie, a validation image seen in training or "
            f"test makes model selection one; remove one copy of each:\n{shown}"
        )
    return out


def scan_folder(base: Path, cache_dir: Path) -> Scan:
    """Read `base` (train/, test/ or val/ by its old name, and an optional validation split),
    decode what is new, check it.

    Problems are listed in `Scan.problems`, not raised: validation reports them with the config
    key. A missing train/ stops the scan there (nothing else can be said)."""
    folders, problems, notes = _split_folders(base)
    if not (base / "train").is_dir():
        problems.insert(
            0,
            f"{base / 'train'} is not a folder: an image folder needs {base}/train/<class>/"
            f"<images> and {base}/test/<class>/<images> (torchvision's ImageFolder layout)",
        )
        return Scan(base, folders, {}, {}, problems, notes)
    listing = {s: _class_files(base / f) for s, f in folders.items()}
    problems += _listing_problems(base, folders, listing)
    images = {
        s: {c: [n for n in names if n.lower().endswith(EXTENSIONS)] for c, names in cls.items()}
        for s, cls in listing.items()
    }
    paths = {
        f"{folders[s]}/{c}/{n}": base / folders[s] / c / n
        for s, cls in images.items()
        for c, names in cls.items()
        for n in names
    }
    entries = _entries(paths, manifest_file(cache_dir, base))
    scan = Scan(base, folders, images, entries, problems, notes)
    problems += _content_problems(scan)
    return scan


def _hash_file(path: Path, opener=open) -> str:
    h = hashlib.sha256()
    with opener(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_fingerprint(files: dict[str, Path], cache_dir: Path, opener=open) -> str | None:
    """Content fingerprint of named files (name -> path; `opener` reads them, e.g. gzip.open
    for the packed copy of a file): hashes remembered by path, size and mtime, so only a new or
    changed file is read. None while any file is absent (not fetched yet)."""
    if not files or not all(p.is_file() for p in files.values()):
        return None
    cache = manifest_file(cache_dir, Path("files"))
    known = _read_cache(cache)
    rows, changed = [], False
    for name, p in sorted(files.items()):
        st, key = p.stat(), f"{opener.__module__}:{p.resolve()}"
        e = known.get(key)
        if e is None or (e.size, e.mtime_ns) != (st.st_size, st.st_mtime_ns):
            e = known[key] = Entry(st.st_size, st.st_mtime_ns, _hash_file(p, opener), None, None)
            changed = True
        rows.append([name, e.sha256])
    if changed:
        _write_cache(cache, known)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()
