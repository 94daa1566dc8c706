"""README.md runs as written. Every fenced block is one of:

- ``console``: a transcript. Each ``$ command`` (continued by a trailing backslash) runs with
  bash; the lines under it, up to the next ``$``, are what it prints on stdout. ``[..]`` in an
  expected line stands for any text within that line, and a line ``...`` for any lines. The
  command must exit 0, or with the status a last line ``? N`` gives.
- ``python``: runs in a fresh interpreter (this venv's, where the package under test is
  installed) and must exit 0.
- ``text`` (or no language): not code (diagrams, sample files).

The blocks run in the README's order, in one scratch folder that holds a link to each of the
clone's top-level entries: "from the clone's root" as the README says, while what the
commands write lands in the scratch folder, never in the clone (cargo builds into the clone's
``target/``). A newcomer meets the blocks in that order, so a later block may use what an
earlier one wrote. ``scripts/test.sh`` itself is not run here (this test is part of it): the
test checks instead that the README's test command is the one ``.ci/run`` runs.

``RESHARD_README_UPDATE=1`` rewrites the transcripts' outputs in README.md with what the
commands print now (then put ``[..]`` back where the text varies: timings, rates)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
KNOWN = {"console", "python", "text", ""}
TEST_COMMAND = "scripts/test.sh"


@dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    start: int  # offsets of the body in README.md
    end: int


def blocks(text: str) -> list[Block]:
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, m.start(2), m.end(2))
            for m in FENCE.finditer(text)]


@dataclass
class Step:
    command: str
    expected: list[str]
    status: int


def transcript(body: str) -> list[Step]:
    steps: list[Step] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        if not ln.startswith("$ "):
            raise AssertionError(f"transcript line outside a command's output: {ln!r}")
        cmd = ln[2:]
        while cmd.endswith("\\"):
            i += 1
            cmd = cmd + "\n" + lines[i]
        i += 1
        out = []
        while i < len(lines) and not lines[i].startswith("$ "):
            out.append(lines[i])
            i += 1
        status = 0
        if out and re.fullmatch(r"\? \d+", out[-1]):
            status = int(out.pop()[2:])
        steps.append(Step(cmd, out, status))
    return steps


def matches(expected: list[str], got: list[str]) -> bool:
    """``got`` against ``expected`` with ``[..]`` (any text in a line) and ``...`` (any lines)."""
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head == "...":
        return any(matches(rest, got[k:]) for k in range(len(got) + 1))
    if not got:
        return False
    pattern = ".*".join(re.escape(p) for p in head.split("[..]"))
    return re.fullmatch(pattern, got[0]) is not None and matches(rest, got[1:])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The scratch folder: a link to each top-level entry of the clone (not target/, not
    .git); cargo's target directory the clone's, its install root in the scratch folder, and
    on PATH first what it installs, then this venv's ``reshard``."""
    d = tmp_path_factory.mktemp("readme")
    for p in REPO.iterdir():
        if p.name not in {"target", ".git"}:
            (d / p.name).symlink_to(p)
    # `cargo install` puts the command into the scratch folder, not the machine's ~/.cargo
    bin_dir = d / "cargo-home" / "bin"
    env = dict(os.environ,
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               CARGO_TARGET_DIR=str(REPO / "target"), CARGO_INSTALL_ROOT=str(d / "cargo-home"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return d, env


def test_every_block_is_code_that_runs_or_text():
    found = blocks(README.read_text())
    assert found, "README.md has no blocks"
    odd = [(b.line, b.lang) for b in found if b.lang not in KNOWN]
    assert not odd, f"blocks of a language this test cannot run (line, language): {odd}"
    assert any(b.lang == "console" for b in found) and any(b.lang == "python" for b in found)


def test_the_readme_test_command_is_what_ci_runs():
    text = README.read_text()
    commands = [s.command for b in blocks(text) if b.lang == "console" for s in transcript(b.text)]
    assert TEST_COMMAND in commands, f"the README shows no `{TEST_COMMAND}` block"
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert f"bash {TEST_COMMAND}" in ci, ci


def test_readme_runs_as_written(workdir):
    d, env = workdir
    text = README.read_text()
    failures, updates = [], []
    for b in blocks(text):
        if b.lang == "python":
            r = subprocess.run([sys.executable, "-c", b.text], cwd=d, env=env, capture_output=True,
                               text=True, timeout=600)
            if r.returncode != 0:
                failures.append(f"README.md:{b.line}: python block exited {r.returncode}:\n{r.stderr[-3000:]}")
        elif b.lang == "console":
            new_lines = []
            for s in transcript(b.text):
                new_lines.append("$ " + s.command)
                if s.command == TEST_COMMAND:  # this test is part of it: checked above instead
                    new_lines.extend(s.expected)
                    continue
                r = subprocess.run(["bash", "-euo", "pipefail", "-c", s.command], cwd=d, env=env,
                                   capture_output=True, text=True, timeout=1200)
                got = r.stdout.splitlines()
                if r.returncode != s.status:
                    failures.append(f"README.md:{b.line}: `{s.command}` exited {r.returncode}, not "
                                    f"{s.status}:\n{r.stderr[-3000:]}")
                elif not matches(s.expected, got):
                    failures.append(f"README.md:{b.line}: `{s.command}` printed:\n" + "\n".join(got)
                                    + "\n-- the README shows:\n" + "\n".join(s.expected))
                new_lines.extend(s.expected if matches(s.expected, got) else got)
                if s.status:
                    new_lines.append(f"? {s.status}")
            updates.append((b, "\n".join(new_lines) + "\n"))
    failures.extend(_debug_info_in_what_was_installed(d))
    if os.environ.get("RESHARD_README_UPDATE") == "1":
        for b, body in reversed(updates):
            text = text[:b.start] + body + text[b.end:]
        README.write_text(text)
    assert not failures, "\n\n".join(failures)


def _elf_section_names(path: Path) -> set[str]:
    """The section names of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not a 64-bit LE ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    return {data[names + h[0]:data.index(b"\0", names + h[0])].decode() for h in headers}


def _debug_info_in_what_was_installed(d: Path) -> list[str]:
    """What the README's install commands put in place (the `reshard` binary `cargo install`
    built, the native module `pip install ./python` built) carries no debug info: the release
    profile is what users build."""
    installed = [d / "cargo-home" / "bin" / "reshard",
                 *sorted(d.glob("venv/lib/python*/site-packages/reshard/_reshard*.so"))]
    failures = []
    for f in installed:
        if not f.exists():
            failures.append(f"{f}: not installed by the README's commands")
            continue
        debug = sorted(n for n in _elf_section_names(f) if n.startswith(".debug"))
        if debug:
            failures.append(f"{f} ({f.stat().st_size >> 20} MiB) carries debug info: {debug}")
    if len(installed) < 2:
        failures.append(f"no native module under {d}/venv (pip install ./python)")
    return failures


def test_matching_rules():
    assert matches(["wrote x in [..] s"], ["wrote x in 0.04 s"])
    assert not matches(["wrote x in [..] s"], ["wrote y in 0.04 s"])
    assert matches(["a", "...", "z"], ["a", "b", "c", "z"]) and matches(["a", "...", "z"], ["a", "z"])
    assert not matches(["a"], ["a", "b"]) and not matches(["a", "b"], ["a"])
    steps = transcript("$ a \\\n  b\nout\n? 1\n$ c\n")
    assert [(s.command, s.expected, s.status) for s in steps] == [("a \\\n  b", ["out"], 1), ("c", [], 0)]


def test_options_table_is_what_convert_help_lists():
    """The README's table of options names every option `reshard convert --help` lists, and
    every format its --format accepts."""
    reshard = Path(sys.executable).parent / "reshard"
    help_text = subprocess.run([str(reshard), "convert", "--help"], capture_output=True, text=True,
                               check=True).stdout
    in_help = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", help_text, re.M)) - {"--help"}
    text = README.read_text()
    table = text[text.index("Options of `plan` and `convert`"):]
    table = table[:table.index("\n\n", table.index("| option"))]
    rows = [ln.split("|")[1:3] for ln in table.splitlines() if ln.startswith("| `")]
    in_table = {o for first, _ in rows for o in re.findall(r"`(--[\w-]+)", first)}
    assert in_table == in_help, (sorted(in_help - in_table), sorted(in_table - in_help))
    formats_help = re.search(r"Output format: ([^(]+?) \(", " ".join(help_text.split())).group(1)
    formats_help = set(re.split(r", | or ", formats_help))
    format_row = next(meaning for first, meaning in rows if "`--format" in first)
    formats_table = set(re.findall(r"`([\w-]+)`", format_row.split("(")[0]))
    assert formats_table == formats_help, (formats_help, formats_table)
