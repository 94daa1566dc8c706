"""The release wheel as a user without Rust gets it: the manylinux abi3 wheel that
``scripts/build_wheel.sh`` builds (``scripts/test.sh`` builds it once, for every Python test,
and names it in ``$RESHARD_WHEEL``). Its file name and its ``WHEEL`` metadata carry the tag
``cp310-abi3-manylinux_2_17_<arch>``; its native module needs only the libraries and the
glibc symbol versions the manylinux_2_17 policy allows (read from the ELF file itself, no
auditwheel needed); and ``pip install --no-index`` of it into a fresh venv, with a PATH and
environment holding no cargo or rustc, gives a ``reshard`` command and a package that opens
a committed DCP fixture and converts it to tensors equal to the oracle's bytes, with neither
torch nor numpy installed. Everything here takes a few seconds: no build."""

import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="manylinux wheels are Linux's")

REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "tests" / "fixtures" / "fsdp2_w2_f32"

# The release policy (scripts/build_wheel.sh, .github/workflows/release.yml): manylinux2014.
POLICY_GLIBC = (2, 17)
# What manylinux_2_17 lets an extension module link (PEP 599's list, minus the X11/GL ones a
# checkpoint library has no business with). abi3 modules must not link libpython.
ALLOWED_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libutil.so.1",
    "libnsl.so.1", "libresolv.so.2", "libgcc_s.so.1", "libstdc++.so.6",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}
# Symbol versions of the other libraries the policy caps (libgcc_s's GCC_*, libstdc++'s).
POLICY_OTHER = {"GCC": (4, 8, 0), "GLIBCXX": (3, 4, 19), "CXXABI": (1, 3, 7)}


def _wheel() -> Path:
    w = os.environ.get("RESHARD_WHEEL")
    if not w or not Path(w).is_file():
        if os.environ.get("CI") == "true":
            pytest.fail("RESHARD_WHEEL is not set to a built wheel (scripts/test.sh sets it)")
        pytest.skip("RESHARD_WHEEL is not set to a built wheel (scripts/test.sh sets it; "
                    "or scripts/build_wheel.sh builds one)")
    return Path(w)


def _arch() -> str:
    return {"arm64": "aarch64"}.get(platform.machine(), platform.machine())


def _parse_name(name: str):
    # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl (PEP 427)
    m = re.fullmatch(r"([^-]+)-([^-]+)(?:-\d[^-]*)?-([^-]+)-([^-]+)-([^-]+)\.whl", name)
    assert m, f"not a wheel file name: {name}"
    return m.groups()


def test_wheel_tag_and_metadata():
    wheel = _wheel()
    dist, version, py, abi, plats = _parse_name(wheel.name)
    assert (dist, py, abi) == ("reshard", "cp310", "abi3"), wheel.name
    plat_tags = plats.split(".")
    arch = _arch()
    # maturin writes the PEP 600 tag and its legacy alias (pip < 20.3 knows only the latter)
    assert f"manylinux_2_17_{arch}" in plat_tags, plat_tags
    for p in plat_tags:
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)|manylinux2014_(\w+)", p)
        assert m, f"{p}: not a manylinux tag"
        if m.group(1):
            assert (int(m.group(1)), int(m.group(2))) <= POLICY_GLIBC and m.group(3) == arch, p
        else:
            assert m.group(4) == arch, p

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"{dist}-{version}.dist-info"
        meta = zf.read(f"{info}/WHEEL").decode()
        fields = [tuple(s.strip() for s in line.split(":", 1)) for line in meta.splitlines() if ":" in line]
        assert ("Root-Is-Purelib", "false") in fields, meta
        assert ("Wheel-Version", "1.0") in fields, meta
        tags = {v for k, v in fields if k == "Tag"}
        assert tags == {f"{py}-{abi}-{p}" for p in plat_tags}, meta

        pkg = zf.read(f"{info}/METADATA").decode()
        head = dict(tuple(s.strip() for s in line.split(":", 1)) for line in pkg.split("\n\n")[0].splitlines()
                    if ":" in line and not line.startswith(" "))
        assert head["Name"] == "reshard" and head["Version"] == version, head
        assert head["Requires-Python"] == ">=3.10", head
        # no dependency a plain install must fetch (torch and numpy are extras)
        required = [l for l in pkg.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
        assert not required, required

        eps = zf.read(f"{info}/entry_points.txt").decode()
        assert re.search(r"^reshard\s*=\s*reshard\._cli:main$", eps, re.M), eps
        sos = [n for n in names if n.startswith("reshard/") and n.endswith(".so")]
        assert sos == ["reshard/_reshard.abi3.so"], sos
        for f in ("reshard/__init__.py", "reshard/torch.py", "reshard/py.typed", f"{info}/RECORD"):
            assert f in names, f
        # a wheel with build products only: no tests, fixtures or Cargo folders
        assert not [n for n in names if n.startswith(("tests/", "target/", "src/"))]


# --- the native module's ELF dynamic section and version needs ------------------------------

def _elf_needs(data: bytes):
    """(DT_NEEDED names, {library: {version names}}, rpath/runpath) of a 64-bit
    little-endian ELF shared object."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit LE ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def cstr(sec_index: int, off: int) -> str:
        base = secs[sec_index][4] + off
        return data[base:data.index(b"\0", base)].decode()

    needed, paths, versions = [], [], {}
    for _name, typ, _fl, _addr, off, size, link, info, _al, _ent in secs:
        if typ == 6:  # SHT_DYNAMIC
            for i in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, off + i)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(link, val))
                elif tag in (15, 29):  # DT_RPATH, DT_RUNPATH
                    paths.append(cstr(link, val))
        elif typ == 0x6FFFFFFE:  # SHT_GNU_verneed
            at = off
            for _ in range(info):
                _v, cnt, file_, aux, nxt = struct.unpack_from("<HHIII", data, at)
                lib = cstr(link, file_)
                a = at + aux
                for _ in range(cnt):
                    _h, _f, _o, name, anext = struct.unpack_from("<IHHII", data, a)
                    versions.setdefault(lib, set()).add(cstr(link, name))
                    a += anext
                at += nxt
    return needed, versions, paths


def _ver(text: str):
    return tuple(int(x) for x in text.split("."))


def test_native_module_within_manylinux_policy(tmp_path):
    wheel = _wheel()
    with zipfile.ZipFile(wheel) as zf:
        so = zf.read("reshard/_reshard.abi3.so")
    needed, versions, paths = _elf_needs(so)
    assert set(needed) <= ALLOWED_LIBS, f"libraries outside the manylinux policy: {set(needed) - ALLOWED_LIBS}"
    assert not any(n.startswith("libpython") for n in needed)
    assert not paths, f"RPATH/RUNPATH: {paths}"
    assert "libc.so.6" in needed
    glibc = set()
    for lib, names in versions.items():
        for v in names:
            kind, _, num = v.partition("_")
            if kind == "GLIBC" and num[0].isdigit():
                glibc.add(_ver(num))
                assert _ver(num) <= POLICY_GLIBC, f"{lib} {v} is newer than manylinux_2_17 allows"
            elif kind in POLICY_OTHER and num[:1].isdigit():
                assert _ver(num) <= POLICY_OTHER[kind], f"{lib} {v} is newer than manylinux_2_17 allows"
            else:  # GLIBC_PRIVATE and the like: no stable ABI
                pytest.fail(f"{lib}: symbol version {v} is outside the manylinux policy")
    assert glibc, versions  # the parser found the version needs
    # the same as binutils reads them, where binutils is installed
    if shutil.which("objdump"):
        f = tmp_path / "_reshard.abi3.so"
        f.write_bytes(so)
        out = subprocess.run(["objdump", "-p", str(f)], capture_output=True, text=True, check=True).stdout
        theirs = set(re.findall(r"\b(GLIBC_\d[\d.]*)\b", out.split("Version References:")[-1]))
        assert theirs == {n for s in versions.values() for n in s if n.startswith("GLIBC_")}
    print(f"\n{wheel.name}: needs {sorted(needed)}, newest glibc symbol version "
          f"GLIBC_{'.'.join(map(str, max(glibc)))}")


# --- installed in a fresh venv, with no Rust toolchain reachable -----------------------------

PROBE = r"""
import importlib.util, json, shutil, sys
import reshard
src, out = sys.argv[1], sys.argv[2]
with reshard.open(src) as ck:
    infos = {t.name: [t.dtype, list(t.shape)] for t in ck.tensors()}
    world, fmt = ck.world_size, ck.format
reshard.convert(src, out, world_size=1)
v = reshard.verify(out)
print(json.dumps({
    "file": reshard.__file__, "version": reshard.__version__, "world": world, "format": fmt,
    "infos": infos, "verified": v["ok"],
    "cargo": shutil.which("cargo"), "rustc": shutil.which("rustc"),
    "numpy": importlib.util.find_spec("numpy") is not None,
    "torch": importlib.util.find_spec("torch") is not None or "torch" in sys.modules,
}))
"""

_DTYPE_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}


def _safetensors(path: Path) -> dict:
    """{name: (dtype, shape, bytes)} of a safetensors file, read with the standard library."""
    raw = path.read_bytes()
    n, = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        count = 1
        for d in h["shape"]:
            count *= d
        assert b - a == count * _DTYPE_SIZE[h["dtype"]], name
        out[name] = (h["dtype"], h["shape"], data[a:b])
    return out


def _no_rust_env(venv: Path) -> dict:
    """The environment with no Rust toolchain: PATH without any folder that holds cargo,
    rustc or rustup (~/.cargo/bin, a rustup toolchain's bin, /usr/bin where Debian's cargo
    is...), no CARGO_*/RUSTUP_*/RUST* variables, the fresh venv first on PATH."""
    tools = ("cargo", "rustc", "rustup")
    keep = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or any(os.path.exists(os.path.join(d, t)) for t in tools):
            continue
        keep.append(d)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CARGO", "RUSTUP", "RUST", "VIRTUAL_ENV", "PYTHON", "PIP_"))}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *keep])
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_installs_and_runs_without_rust(tmp_path):
    wheel = _wheel()
    _dist, version, *_ = _parse_name(wheel.name)
    venv = tmp_path / "venv"
    env = _no_rust_env(venv)
    for t in ("cargo", "rustc", "rustup"):
        assert shutil.which(t, path=env["PATH"]) is None, t

    def run(args, **kw):
        r = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env,
                           cwd=str(tmp_path), timeout=300, **kw)
        assert r.returncode == 0, f"{args}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    # a fresh venv of this interpreter; the wheel from the file alone (--no-index: it needs
    # nothing from an index, and pip would fail if it asked for a build)
    run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "--no-index", "--only-binary", ":all:", wheel])

    cli = venv / "bin" / "reshard"
    assert cli.is_file()
    assert run([cli, "--version"]).split() == ["reshard", version]
    shown = run([cli, "inspect", CASE / "checkpoint"])
    assert "model.embed.weight" in shown and "optimizer.state" in shown, shown

    out = tmp_path / "full.safetensors"
    got = json.loads(run([py, "-c", PROBE, CASE / "checkpoint", out]).strip().splitlines()[-1])
    assert Path(got["file"]).resolve().is_relative_to(venv.resolve()), got["file"]
    assert got["version"] == version
    assert (got["cargo"], got["rustc"]) == (None, None)
    assert not got["numpy"] and not got["torch"], "the fresh venv has only reshard"
    assert got["world"] == 2 and got["format"] == "dcp" and got["verified"]

    want = _safetensors(CASE / "oracle" / "full.safetensors")
    have = _safetensors(out)
    assert len(want) > 20 and set(have) == set(want), set(have) ^ set(want)
    for name, (dtype, shape, data) in want.items():
        assert got["infos"][name] == [dtype, shape], name
        assert have[name] == (dtype, shape, data), f"{name}: differs from the oracle"
