"""Mutation check: does the default suite catch a one-line bug in the bookkeeping, the masks and the state code?

    nice -n 10 .venv/bin/python scripts/mutation_check.py            # every mutation, after a clean baseline run
    nice -n 10 .venv/bin/python scripts/mutation_check.py --readme   # ... and write the results into tests/README.md
    nice -n 10 .venv/bin/python scripts/mutation_check.py --suite-order --readme   # the suite in its own order
    .venv/bin/python scripts/mutation_check.py --list                # check the table only (each old text once)

For each mutation of ``MUTATIONS`` the working tree (tracked and untracked, not ignored files: what ``git ls-files
-co --exclude-standard`` lists; ``vendor/`` linked, the compiled calls copied) is copied to a fresh temporary
folder, the one line is changed there, and the whole default suite runs on the copy (``python -m pytest -x -p
no:cacheprovider``, fail-fast, ``CI=true`` so that hypothesis replays its fixed examples).  The repository itself is
never modified.  A mutation is caught when the suite fails; the first failing test is reported.  Before the mutations,
the unmodified copy must pass.

By default the golden traces (``tests/test_golden_traces.py``) run first and then the rest of the default suite
(the same tests, each once): the check then shows directly whether the golden traces catch each mutation, and a
caught mutation costs seconds, not a hypothesis shrink.  ``--suite-order`` runs the suite in its own order instead
(the first failing test is then whichever comes first; when it is not a golden trace, the golden traces are run
alone on the same copy to fill in their column).

``MUTATIONS`` is the one place to update when code moves: each entry is (name, path, exact old text, new text), and
the script stops before running anything when an old text is not found exactly once in its file.  Exit status: 0
when every mutation was caught, 1 when one survived or the baseline failed, 2 on a bad table.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, path, exact old text, new text): one-line bugs the default suite must catch
MUTATIONS = [
    ("head-reset constant (slot_search_start)", "kvcache_ggml/cache/cells/onecell.py",
     "return 0 if head > n_used + 2 * n_tokens else head",
     "return 0 if head > n_used + 3 * n_tokens else head"),
    ("find_slot skips the restart at cell 0", "kvcache_ggml/cache/bookkeeping.py",
     "head_cur = slot_search_start(self.v_heads[strm], cells.get_used(), n_tokens)",
     "head_cur = self.v_heads[strm]"),
    ("unified decode placement skips find_slot's restart", "kvcache_ggml/cache/decode_step.py",
     "h = slot_search_start(book.v_heads[0], c.get_used(), n)",
     "h = book.v_heads[0]"),
    ("no wrap-around in the slot scan", "kvcache_ggml/cache/bookkeeping.py",
     "found = np.concatenate([np.flatnonzero(u[head:]) + head, np.flatnonzero(u[:head])])",
     "found = np.flatnonzero(u[head:]) + head"),
    ("seq_rm head lowering off by one", "kvcache_ggml/cache/bookkeeping.py",
     "if emptied.size and emptied[0] < self.v_heads[strm]:",
     "if emptied.size and emptied[0] + 1 < self.v_heads[strm]:"),
    ("decode undo's head lowering off by one", "kvcache_ggml/cache/bookkeeping.py",
     "if 0 <= i < self.v_heads[strm]:",
     "if 0 <= i + 1 < self.v_heads[strm]:"),
    ("seq_add keeps the head", "kvcache_ggml/cache/bookkeeping.py",
     "self.v_heads[strm] = int(emptied[0]) if emptied.size else 0",
     "self.v_heads[strm] = int(emptied[0]) if emptied.size else self.v_heads[strm]"),
    ("prepare restores heads by stream", "kvcache_ggml/cache/bookkeeping.py",
     "self.v_heads[st] = heads_old[s]",
     "self.v_heads[st] = heads_old[st]"),
    ("n_kv padded to 128", "kvcache_ggml/cache/bookkeeping.py",
     "n_pad_cur = max(self.n_pad, 256)",
     "n_pad_cur = max(self.n_pad, 128)"),
    ("SWA standard bound, scalar (swa_masked)", "kvcache_ggml/hparams.py",
     "return p1 - p0 >= n_swa",
     "return p1 - p0 > n_swa"),
    ("SWA symmetric bound, scalar (swa_masked)", "kvcache_ggml/hparams.py",
     "return p1 - p0 < -half or p1 - p0 > half",
     "return p1 - p0 < -half or p1 - p0 >= half"),
    ("SWA standard bound, vectorised (swa_bounds: masks, is_masked_swa_np)", "kvcache_ggml/hparams.py",
     "return p - n_swa + 1, None",
     "return p - n_swa, None"),
    ("SWA symmetric lower bound, vectorised (swa_bounds)", "kvcache_ggml/hparams.py",
     "return p - half, p + half",
     "return p - half + 1, p + half"),
    ("SWA symmetric upper bound, vectorised (swa_bounds)", "kvcache_ggml/hparams.py",
     "return p - half, p + half",
     "return p - half, p + half - 1"),
    ("mask causal test (rows)", "kvcache_ggml/cache/masks.py",
     "masked = np.greater(pos, hi[:, None])",
     "masked = np.greater_equal(pos, hi[:, None])"),
    ("mask causal test (decode row)", "kvcache_ggml/cache/masks.py",
     "hidden |= cells.pos_array[:n_kv] > p1",
     "hidden |= cells.pos_array[:n_kv] >= p1"),
    ("decode init skips the continuity check", "kvcache_ggml/batch/_allocator.py",
     "    if p < -1 or (m >= 0 and p != m + 1):  # (the general path's errors)",
     "    if p < -1:  # (the general path's errors)"),
    ("decode undo ignores a second position in range", "kvcache_ggml/cache/cells/kvcells.py",
     "if p < p0 or p >= p1 or ms.counts[-1] != 1 or (len(keys) > 1 and keys[-2] >= p0):",
     "if p < p0 or p >= p1 or ms.counts[-1] != 1:"),
    ("decode placement over an occupied cell", "kvcache_ggml/cache/bookkeeping.py",
     "            if v_cells[st].pos_at(i) >= 0:",
     "            if v_cells[st].pos_at(i) >= 0 and False:"),
    ("wrapped-window prepare skips the purge of older positions", "kvcache_ggml/cache/swa_step.py",
     "    if keys[0] < p or counts[0] > 1 or (tok_seq == q and tok_pos <= p):",
     "    if counts[0] > 1 or (tok_seq == q and tok_pos <= p):"),
    ("ready mask rows skip a single-cell change", "kvcache_ggml/cache/mask_rows.py",
     "for k in range(self.n_ones, n_ones):",
     "for k in range(self.n_ones + 1, n_ones):"),
    ("ready token rows take a lost sequence for a gained one", "kvcache_ggml/cache/mask_rows.py",
     "rows_m[i, c] = 0 if seq_m[w, c] >> sh & 1 else self.neg_i",
     "rows_m[i, c] = 0"),
    ("ready mask rows for a token below its sequence's end", "kvcache_ggml/cache/mask_rows.py",
     "        if lo < 0 or (causal and hi > p1):  # (lo -1: no cell, or a cell at -1)",
     "        if lo < 0 or (causal and hi > p1 + 1):  # (lo -1: no cell, or a cell at -1)"),
    ("kept row unmasks a cell on its one new entry", "kvcache_ggml/cache/mask_rows.py",
     "self.rows_m[i, c] = 0 if self.seq_m[i][s >> 6, c] >> (s & 63) & 1 else self.neg_i",
     "self.rows_m[i, c] = 0"),
    ("decode ubatch's int position off by one", "kvcache_ggml/batch/_allocator.py",
     "(self._seqs[0], pos.item(0)) if n == 1",
     "(self._seqs[0], pos.item(0) + 1) if n == 1"),
    ("find_slot's one-token cell skips the restart at cell 0", "kvcache_ggml/cache/cells/kvcells.py",
     "        head = slot_search_start(head, self._used.n, 1)\n",
     "        head = head\n"),
    ("find_slot's decode path takes the head without the one-token rule", "kvcache_ggml/cache/bookkeeping.py",
     "        i = cells.one_token_cell(self.v_heads[strm]) if n_tokens == 1 and not cont else -1\n",
     "        i = self.v_heads[strm] if n_tokens == 1 and not cont and cells.pos_at(min(self.v_heads[strm], self.kv_size - 1)) < 0 else -1\n"),
    ("kept mask rows copied as bytes when not one span", "kvcache_ggml/cache/mask_rows.py",
     "        if len(self.seqs) == 1 or n_kv == self.rows.shape[1]:",
     "        if len(self.seqs) >= 1 or n_kv == self.rows.shape[1]:"),
    ("state: v_trans flag written", "kvcache_ggml/cache/state/codec.py",
     "io.write(DATA_HDR.pack(int(t.v_trans), len(t.layers)))",
     "io.write(DATA_HDR.pack(int(not t.v_trans), len(t.layers)))"),
    ("state: cells written in reverse", "kvcache_ggml/cache/state/codec.py",
     "idxs = np.flatnonzero(mask)\n",
     "idxs = np.flatnonzero(mask)[::-1]\n"),
]

# ignored folders the default suite reads: build.py's unpacked ggml-python source (test_bindings reads its
# headers) and the GPU check's carried payload (tests/test_gpu_check.py checks it under CI)
LINKED = ("vendor", ".carry")
BUILT = ("kvcache_ggml/ggml/_ops_cffi.*",)  # git-ignored build outputs the suite uses, copied (build.py makes them)
README = ROOT / "tests" / "README.md"
GOLDEN = "tests/test_golden_traces.py"


@dataclass(slots=True)
class Outcome:
    """What the default suite did on one copy."""

    name: str          # the mutation ("baseline": none)
    rc: int            # pytest's exit status (0: passed, 1: a test failed, other: error)
    first: str         # the first failing test (node id), or the error
    seconds: float     # wall time of the run
    tail: str          # the end of pytest's output
    golden: bool       # the golden traces failed (caught the mutation)


def check_table(root: Path) -> list[str]:
    """Problems with MUTATIONS against the tree at ``root`` (an old text not found exactly once)."""
    bad = []
    for name, path, old, new in MUTATIONS:
        f = root / path
        if not f.exists():
            bad.append(f"{name}: {path} does not exist")
            continue
        n = f.read_text().count(old)
        if n != 1:
            bad.append(f"{name}: {old!r} found {n} times in {path}, expected exactly once")
        if old == new:
            bad.append(f"{name}: the new text is the old text")
    return bad


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, into ``dst``; the ignored build outputs the
    suite reads (``LINKED``) as links to the originals (no mutation touches them)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is skipped
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    for rel in LINKED:
        if (ROOT / rel).exists():
            (dst / rel).symlink_to((ROOT / rel).resolve(), target_is_directory=True)
    for pattern in BUILT:
        for src in ROOT.glob(pattern):
            shutil.copy2(src, dst / src.relative_to(ROOT))


def run_suite(root: Path, name: str, timeout: int, paths: list[str]) -> Outcome:
    """pytest -x on ``paths`` (none: the default suite in its own order) in the copy at ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), CI="true", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", "--no-header", *paths]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout} s\n{e.stdout or ''}"
    dt = time.perf_counter() - t0
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    first = m.group(1) if m else ("" if rc == 0 else out.strip().splitlines()[-1] if out.strip() else f"rc {rc}")
    return Outcome(name, rc, first, dt, out[-3000:], first.startswith(GOLDEN))


def golden_first(root: Path) -> list[str]:
    """The default suite's paths with the golden traces first (pytest would merge ``GOLDEN tests`` back into
    directory order): GOLDEN, then every other test file and test folder under tests/."""
    rest = [p for p in sorted((root / "tests").iterdir())
            if (p.is_dir() and any(p.rglob("test_*.py")))
            or (p.is_file() and p.name.startswith("test_") and p.suffix == ".py" and p.name != Path(GOLDEN).name)]
    return [GOLDEN] + [str(p.relative_to(root)) for p in rest]


def run_one(name: str, path: str, old: str, new: str, timeout: int, suite_order: bool) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        if path:
            f = root / path
            text = f.read_text()
            assert text.count(old) == 1, f"{name}: {old!r} not found exactly once in the copy"
            f.write_text(text.replace(old, new))
        o = run_suite(root, name, timeout, [] if suite_order else golden_first(root))
        if suite_order and path and o.rc != 0 and not o.golden:
            o.golden = run_suite(root, name, timeout, [GOLDEN]).rc != 0
        return o


def table(results: list[tuple[tuple, Outcome]]) -> str:
    lines = ["| mutation | file | change | caught | first failing test | golden traces | time |",
             "|---|---|---|---|---|---|---|"]
    for (name, path, old, new), o in results:
        caught = "**no**" if o.rc == 0 else "yes" if o.rc == 1 else f"yes (pytest rc {o.rc})"
        one_line = (lambda t: " ⏎ ".join(x.strip() for x in t.strip().splitlines()))  # a table cell is one line
        change = f"`{one_line(old)}` → `{one_line(new)}`".replace("|", "\\|")
        first = o.first.replace("|", "\\|")
        lines.append(f"| {name} | `{path}` | {change} | {caught} | `{first}` | {'yes' if o.golden else 'no'} | "
                     f"{o.seconds:.0f} s |")
    return "\n".join(lines)


def write_readme(text: str, mode: str) -> None:
    begin, end = f"<!-- mutation-check:{mode}:begin -->", f"<!-- mutation-check:{mode}:end -->"
    doc = README.read_text()
    a, b = doc.find(begin), doc.find(end)
    if a < 0 or b < a:
        raise SystemExit(f"{README}: markers {begin} ... {end} not found")
    README.write_text(doc[:a + len(begin)] + "\n" + text + "\n" + doc[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only the mutations whose name contains NAME")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the unmodified tree")
    ap.add_argument("--list", action="store_true", help="check and print the table, run nothing")
    ap.add_argument("--readme", action="store_true", help=f"write the results into {README.relative_to(ROOT)}")
    ap.add_argument("--suite-order", action="store_true",
                    help=f"run the default suite in its own order (default: {GOLDEN} first, then the rest)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per suite run")
    a = ap.parse_args()

    bad = check_table(ROOT)
    if bad:
        print("mutation table does not match the code:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not a.only or any(s in m[0] for s in a.only)]
    if a.list:
        for name, path, old, new in chosen:
            print(f"{name:40s} {path}: {old.strip()!r} -> {new.strip()!r}")
        return 0
    t0 = time.perf_counter()
    if not a.no_baseline:
        base = run_one("baseline", "", "", "", a.timeout, a.suite_order)
        print(f"baseline: rc {base.rc} in {base.seconds:.0f} s", flush=True)
        if base.rc != 0:
            print(f"the unmodified tree fails the default suite ({base.first}):\n{base.tail}", file=sys.stderr)
            return 1
    results = []
    for m in chosen:
        o = run_one(*m, timeout=a.timeout, suite_order=a.suite_order)
        results.append((m, o))
        print(f"{m[0]:40s} {'CAUGHT' if o.rc != 0 else 'SURVIVED':8s} {o.seconds:6.0f} s  {o.first}", flush=True)
    text = table(results)
    survived = [m[0] for m, o in results if o.rc == 0]
    mode = "suite-order" if a.suite_order else "golden-first"
    summary = (f"{len(results) - len(survived)} of {len(results)} mutations caught by the default suite, "
               f"{sum(o.golden for _, o in results)} by the golden traces ({mode}, {time.perf_counter() - t0:.0f} s "
               f"in all with the baseline, {time.strftime('%Y-%m-%d')})")
    print("\n" + text + "\n\n" + summary)
    if a.readme and not a.only:
        write_readme(text + "\n\n" + summary + ".", mode)
    if survived:
        print(f"SURVIVED: {survived}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
