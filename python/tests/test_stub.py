"""The type stub of the native module (python/reshard/_reshard.pyi) against the module itself:
every function, class, method, property and constant the stub declares exists in
``reshard._reshard`` with the same parameters (names, kinds, defaults: PyO3 sets each
builtin's ``__text_signature__``), and every public item of the module is in the stub. The
stub is parsed with ``ast``, never imported."""

import ast
import inspect
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

import reshard
from reshard import _reshard as native

# The stub in the source tree: the file to keep in step with python/src/lib.rs.
STUB = Path(__file__).resolve().parents[1] / "reshard" / "_reshard.pyi"

_KINDS = {
    "posonly": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "vararg": inspect.Parameter.VAR_POSITIONAL,
    "kwonly": inspect.Parameter.KEYWORD_ONLY,
    "kwarg": inspect.Parameter.VAR_KEYWORD,
}
_NO_DEFAULT = object()

# (name, kind, default): a default is a literal value, _NO_DEFAULT, or ... where the stub or
# the text signature cannot say it.
Param = Tuple[str, inspect._ParameterKind, Any]


def _stub_params(fn: ast.FunctionDef, method: bool) -> List[Param]:
    a = fn.args
    out: List[Param] = []
    positional = a.posonlyargs + a.args
    defaults = [_NO_DEFAULT] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = _KINDS["posonly"] if i < len(a.posonlyargs) else _KINDS["args"]
        out.append((arg.arg, kind, d))
    if a.vararg:
        out.append((a.vararg.arg, _KINDS["vararg"], _NO_DEFAULT))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, _KINDS["kwonly"], _NO_DEFAULT if d is None else d))
    if a.kwarg:
        out.append((a.kwarg.arg, _KINDS["kwarg"], _NO_DEFAULT))
    out = [(n, k, _literal(d)) for n, k, d in out]
    return out[1:] if method else out  # the stub's `self`


def _literal(node: Any) -> Any:
    if node is _NO_DEFAULT:
        return node
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


def _runtime_params(obj: Any, method: bool) -> List[Param]:
    sig = inspect.signature(obj)
    out = [
        (p.name, p.kind, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
        for p in sig.parameters.values()
    ]
    return out[1:] if method else out  # PyO3's `$self`


def _same_params(stub: List[Param], runtime: List[Param]) -> bool:
    if [(n, k) for n, k, _ in stub] != [(n, k) for n, k, _ in runtime]:
        return False
    for (_n, _k, a), (_m, _j, b) in zip(stub, runtime):
        if (a is _NO_DEFAULT) != (b is _NO_DEFAULT):
            return False
        if a is not _NO_DEFAULT and a is not ... and b is not ... and a != b:
            return False
    return True


def _show(params: List[Param]) -> str:
    def one(n: str, k: Any, d: Any) -> str:
        star = {_KINDS["vararg"]: "*", _KINDS["kwarg"]: "**"}.get(k, "")
        return f"{star}{n}" + ("" if d is _NO_DEFAULT else f"={d!r}") + (" (kw-only)" if k == _KINDS["kwonly"] else "")

    return "(" + ", ".join(one(*p) for p in params) + ")"


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _is_typed_dict(cls: ast.ClassDef) -> bool:
    return any(isinstance(b, ast.Name) and b.id == "TypedDict" for b in cls.bases)


class Stub:
    """What the stub declares at its top level."""

    def __init__(self, tree: ast.Module) -> None:
        self.functions: Dict[str, ast.FunctionDef] = {}
        self.classes: Dict[str, ast.ClassDef] = {}
        self.typed_dicts: Dict[str, ast.ClassDef] = {}
        self.constants: List[str] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                (self.typed_dicts if _is_typed_dict(node) else self.classes)[node.name] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.constants.append(node.target.id)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    assert isinstance(t, ast.Name) and t.id.startswith("_"), (
                        f"stub line {node.lineno}: a public assignment; declare constants as `NAME: type`"
                    )  # private assignments are type aliases, stub-only

    def names(self) -> set:
        return set(self.functions) | set(self.classes) | set(self.constants)


def _check(stub: Stub, module: Any) -> List[str]:
    """Every disagreement between ``stub`` and ``module``, one line each."""
    bad: List[str] = []
    for name, fn in stub.functions.items():
        obj = getattr(module, name, None)
        if not callable(obj):
            bad.append(f"function {name}: in the stub, not a callable of the module")
            continue
        want, have = _stub_params(fn, False), _runtime_params(obj, False)
        if not _same_params(want, have):
            bad.append(f"function {name}: stub {_show(want)}, module {_show(have)}")
    for name, cls in stub.classes.items():
        obj = getattr(module, name, None)
        if not isinstance(obj, type):
            bad.append(f"class {name}: in the stub, not a class of the module")
            continue
        bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases] or ["object"]
        if [b.__name__ for b in obj.__bases__] != bases:
            bad.append(f"class {name}: stub bases {bases}, module {[b.__name__ for b in obj.__bases__]}")
        declared = set()
        for node in cls.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            declared.add(node.name)
            attr = inspect.getattr_static(obj, node.name, None)
            if attr is None:
                bad.append(f"{name}.{node.name}: in the stub, not in the class")
            elif _is_property(node):
                if not isinstance(attr, (types.GetSetDescriptorType, types.MemberDescriptorType, property)):
                    bad.append(f"{name}.{node.name}: a property in the stub, not in the class")
            elif not callable(attr):
                bad.append(f"{name}.{node.name}: a method in the stub, not in the class")
            else:
                want, have = _stub_params(node, True), _runtime_params(getattr(obj, node.name), True)
                if not _same_params(want, have):
                    bad.append(f"method {name}.{node.name}: stub {_show(want)}, module {_show(have)}")
        for attr in vars(obj):
            if not attr.startswith("_") and attr not in declared:
                bad.append(f"{name}.{attr}: in the class, not in the stub")
    for name in stub.constants:
        if not hasattr(module, name):
            bad.append(f"{name}: in the stub, not in the module")
    public = {n for n in dir(module) if not n.startswith("_")} | {"__version__"}
    for name in sorted(public - stub.names()):
        bad.append(f"{name}: in the module, not in the stub")
    return bad


@pytest.fixture(scope="module")
def stub() -> Stub:
    return Stub(ast.parse(STUB.read_text(), filename=str(STUB)))


def test_stub_matches_module(stub):
    bad = _check(stub, native)
    assert not bad, "python/reshard/_reshard.pyi and the native module disagree:\n" + "\n".join(bad)


def test_the_check_sees_drift(stub):
    """The check itself: a renamed parameter, a missing function, an extra item are found."""
    src = STUB.read_text()
    renamed = Stub(ast.parse(src.replace("def diff(a: str, b: str)", "def diff(a: str, c: str)")))
    assert any(line.startswith("function diff:") for line in _check(renamed, native))
    kw = Stub(ast.parse(src.replace("dst: str, *, overwrite: bool = False", "dst: str, overwrite: bool = False")))
    assert any(line.startswith("function commit:") for line in _check(kw, native))
    default = Stub(ast.parse(src.replace("verify: bool = True, staging", "verify: bool = False, staging")))
    assert any(line.startswith("function commit:") for line in _check(default, native))
    gone = Stub(ast.parse(src.replace("def is_url(", "def _not_is_url(")))
    assert "is_url: in the module, not in the stub" in _check(gone, native)
    prop = Stub(ast.parse(src.replace("def nbytes(self) -> int: ...", "def nbytes2(self) -> int: ...")))
    assert {"NativeCheckpoint.nbytes2: in the stub, not in the class",
            "NativeCheckpoint.nbytes: in the class, not in the stub"} <= set(_check(prop, native))


def _keys(td: ast.ClassDef) -> List[Tuple[str, str]]:
    return [
        (n.target.id, ast.unparse(n.annotation))
        for n in td.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def test_convert_options(stub, tmp_path):
    """``convert(src, dst, *, world_size, **options)``: the stub's ``_ConvertOptions`` are the
    module's ``CONVERT_OPTIONS``, each accepted by the native convert, any other refused."""
    fn = stub.functions["convert"]
    assert fn.args.kwarg is not None and ast.unparse(fn.args.kwarg.annotation) == "Unpack[_ConvertOptions]"
    keys = _keys(stub.typed_dicts["_ConvertOptions"])
    assert isinstance(native.CONVERT_OPTIONS, tuple)
    assert [k for k, _ in keys] == list(native.CONVERT_OPTIONS)
    missing = str(tmp_path / "missing")
    for key, annotation in keys:
        value: Optional[bool] = False if annotation == "bool" else None
        # accepted: the call goes on to find the source missing
        with pytest.raises(reshard.ReshardError):
            native.convert(missing, str(tmp_path / "out"), world_size=1, **{key: value})
    with pytest.raises(TypeError, match="convert\\(\\) got an unexpected keyword argument 'bogus'"):
        native.convert(missing, str(tmp_path / "out"), world_size=1, bogus=1)
    with pytest.raises(TypeError, match="argument 'untie'"):
        native.convert(missing, str(tmp_path / "out"), world_size=1, untie="yes")
