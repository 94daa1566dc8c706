"""The command line the fixture generators (scripts/gen_deepspeed.py, gen_megatron.py,
gen_torchtitan.py) share: ``--out``, ``--only NAME...`` and ``--list`` over a table of cases,
and the loop that generates the chosen ones and says how long they took."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["parser", "generate_cases", "files", "write_case"]


def parser(doc: str, out: Path, workers: Sequence[str]) -> argparse.ArgumentParser:
    """A parser with the shared options; ``out`` is where the fixtures go by default. The
    generator runs itself under torchrun as ``--worker MODE --case NAME --dir D`` (``MODE`` one
    of ``workers``; ``args.mode``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=out, help=f"where the cases go (default {out})")
    ap.add_argument("--only", nargs="*", help="generate these cases only (default: all)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--worker", choices=list(workers), dest="mode", help=argparse.SUPPRESS)
    ap.add_argument("--case", help="the case a check or a worker is for")
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    return ap


def generate_cases(ap: argparse.ArgumentParser, args: argparse.Namespace, cases: Mapping[str, object],
                   generate: Callable[[str, Path], object], tool: str) -> None:
    """``--list``: print the cases. Otherwise generate each chosen case into ``args.out``
    (an unknown name is a usage error before anything is generated)."""
    if args.list:
        for n, s in cases.items():
            print(n, s)
        return
    names = args.only or list(cases)
    for n in names:
        if n not in cases:
            ap.error(f"unknown case {n}; known: {', '.join(cases)}")
    start = time.monotonic()
    for n in names:
        generate(n, args.out)
    print(f"{tool}: {len(names)} case(s) in {time.monotonic() - start:.0f} s")


def files(ckpt: Path) -> dict:
    """Every file under ``ckpt`` (relative path, as ``/``-joined text) with its size."""
    return {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()}


def write_case(case_dir: Path, info: dict, tool: str, name: str, more: str = "") -> None:
    """Write ``case_dir/case.json`` from ``info`` (whose ``files`` are :func:`files`) and say
    what the case holds (``more`` is appended to that line)."""
    (case_dir / "case.json").write_text(json.dumps(info, indent=1) + "\n")
    held = info["files"]
    print(f"{tool}: {name}: {sum(held.values())} bytes in {len(held)} files{more}")
