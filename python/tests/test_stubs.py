"""The type stubs (python/kvevict/_kvevict.pyi) and docstrings against the binding itself: a
name, a parameter, a default or a keyword-only marker that differs fails here, so the stubs
cannot drift from python/src/."""

import ast
import inspect
import os
import re

import pytest

import kvevict
from kvevict import _kvevict

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kvevict", "_kvevict.pyi")
SIGNATURE = re.compile(r"^(?:\d+\. )?(\w+)\((.*)\) -> .*$")
# What pybind11 adds to every bound class (_pybind11_conduit_v1_: pybind11 >= 2.13, torch 2.x).
PYBIND_INTERNALS = {"__members__", "__entries", "__doc__", "__module__", "__init__", "__len__",
                    "_pybind11_conduit_v1_"}


def split_top(params: str):
    """Splits a pybind11 parameter list at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def binding_signatures(obj, name):
    """Each overload of `obj` as a tuple of parameter names ('x=' with a default, '*' for the
    keyword-only marker), self left out."""
    sigs = []
    for line in (obj.__doc__ or "").splitlines():
        m = SIGNATURE.match(line.strip())
        if not m or m.group(1) != name:
            continue
        params = []
        for p in split_top(m.group(2)):
            if p == "*":
                params.append("*")
                continue
            pname = p.split(":")[0].split("=")[0].strip()
            if pname in ("self", "arg0") and not params:
                continue
            params.append(pname + ("=" if "=" in p else ""))
        sigs.append(tuple(params))
    return sorted(sigs)


def stub_signature(fn: ast.FunctionDef, method: bool):
    a = fn.args
    positional = a.posonlyargs + a.args
    if method:
        positional = positional[1:]
    n_defaults = len(a.defaults)
    params = [p.arg + ("=" if i >= len(positional) - n_defaults else "") for i, p in enumerate(positional)]
    if a.kwonlyargs:
        params.append("*")
        params += [p.arg + ("=" if d is not None else "") for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return tuple(params)


def stub_members(body, method):
    """name -> ('def', [signatures]) | ('attr', None) | ('class', body)."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            if is_property:
                out[node.name] = ("attr", None)
            else:
                out.setdefault(node.name, ("def", []))[1].append(stub_signature(node, method))
        elif isinstance(node, ast.AnnAssign):
            out[node.target.id] = ("attr", None)
        elif isinstance(node, ast.Assign):
            out[node.targets[0].id] = ("alias", None)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ("class", node.body)
    return out


def merge_overloads(sigs):
    """Typing overloads of one binding signature (the same names; attend's `return_probs:
    Literal[False] = False` and `return_probs: Literal[True]`) as that signature: a parameter has
    a default if one of them gives it one."""
    merged = {}
    for sig in sigs:
        names = tuple(p.rstrip("=") for p in sig)
        prev = merged.get(names, sig)
        merged[names] = tuple(a if a.endswith("=") else b for a, b in zip(sig, prev))
    return sorted(merged.values())


STUB_TREE = stub_members(ast.parse(open(STUB).read()).body, method=False)


def public(names):
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))} - PYBIND_INTERNALS


def module_names():
    return public(n for n in vars(_kvevict))


def test_every_binding_name_has_a_stub_and_back():
    stubbed = {n for n, (kind, _) in STUB_TREE.items() if kind != "alias"} - {"__version__"}
    assert module_names() == stubbed


def check_class(cls, body, path):
    members = stub_members(body, method=True)
    bound = public(vars(cls)) | ({"__init__"} if "__init__" in vars(cls) and not issubclass(cls, int) else set())
    if "__len__" in vars(cls):
        bound.add("__len__")
    # pybind11 enums: their __init__ and name/value come from pybind11 itself
    stubbed = set(members)
    assert bound - {"__init__"} == stubbed - {"__init__"}, path
    for name, (kind, sub) in members.items():
        attr = vars(cls).get(name)
        if kind == "class":
            check_class(attr, sub, f"{path}.{name}")
        elif kind == "def" and not isinstance(attr, property):
            assert sorted(set(binding_signatures(getattr(cls, name), name))) == merge_overloads(sub), f"{path}.{name}"


@pytest.mark.parametrize("name", sorted(n for n, (k, _) in STUB_TREE.items() if k in ("def", "class")))
def test_stub_signatures_match_the_binding(name):
    kind, sub = STUB_TREE[name]
    obj = getattr(_kvevict, name)
    if kind == "class":
        check_class(obj, sub, name)
    else:
        # typing overloads that differ only in their annotations (attend's return_probs) are one
        assert sorted(set(binding_signatures(obj, name))) == merge_overloads(sub), name


def doc_text(obj):
    lines = [l for l in (obj.__doc__ or "").splitlines()
             if l.strip() and not SIGNATURE.match(l.strip()) and l.strip() != "Overloaded function."]
    return " ".join(lines).strip()


def test_everything_has_a_docstring():
    missing = []
    for name in sorted(module_names()):
        obj = getattr(_kvevict, name)
        if not doc_text(obj):
            missing.append(name)
        if inspect.isclass(obj):
            for m, attr in vars(obj).items():
                if m.startswith("_") or isinstance(attr, property) or not callable(attr):
                    continue
                if not doc_text(attr):
                    missing.append(f"{name}.{m}")
    assert missing == []


def test_the_package_reexports_the_binding():
    for name in module_names():
        assert getattr(kvevict, name) is getattr(_kvevict, name)
    assert kvevict.__version__ == _kvevict.__version__


def bound_callables():
    """(path, function) of everything the module binds: functions, methods, constructors and the
    getters and setters of properties. pybind11's own members of an enum (``__eq__``, ``name``,
    ...) are pybind11's, not kvevict's, and left out."""
    for name, obj in sorted(vars(_kvevict).items()):
        if inspect.isclass(obj):
            yield from class_callables(obj, name)
        elif callable(obj):
            yield name, obj


def class_callables(cls, path):
    enum = "__members__" in vars(cls)
    for m, attr in sorted(vars(cls).items()):
        if inspect.isclass(attr):
            yield from class_callables(attr, f"{path}.{m}")
        elif enum and (m.startswith("__") and m != "__init__" or m in ("name", "value")):
            continue
        elif isinstance(attr, property):
            for f in (attr.fget, attr.fset):
                if f is not None:
                    yield f"{path}.{m}", f
        elif callable(attr) and m not in ("_pybind11_conduit_v1_",):
            yield f"{path}.{m}", attr


def test_signatures_name_python_types():
    """help() and IDEs show Python's names: torch.Tensor, torch.device | str, torch.dtype; no C++
    type (at::Tensor, c10::...) and no bare `object` (a device or scorer taken as py::object)."""
    leaks = []
    sig = re.compile(r"^(?:\d+\. )?\w*\((.*)\)(?: -> (.*))?$")
    for path, f in bound_callables():
        for line in (f.__doc__ or "").splitlines():
            m = sig.match(line.strip())
            if not m:
                continue
            if "::" in line or re.search(r"\bobject\b", line):
                leaks.append(f"{path}: {line.strip()}")
    assert leaks == []
    init = _kvevict.MlaCacheOptions.__init__.__doc__
    assert "dtype: torch.dtype" in init and "device: torch.device | str = 'cpu'" in init
    assert "q: torch.Tensor" in _kvevict.attend.__doc__
    assert "-> torch.Tensor | tuple[torch.Tensor, torch.Tensor]" in _kvevict.attend.__doc__
    assert "| str = CumulativeAttention()" in _kvevict.MlaCache.__init__.__doc__  # a scorer or its name
