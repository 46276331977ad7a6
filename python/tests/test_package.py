"""The installed package (`pip install .`), which the other tests exercise: it is imported from
the environment, not from the source tree; its Python sources are the tree's (a stale install
fails here: scripts/setup.sh installs again); the shipped weights are inside it, byte for byte
examples/quality/weights.pt; its version is include/kvevict/version.hpp's."""

import hashlib
import importlib.metadata
import os
import re

import kvevict
from kvevict import models

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SOURCE = os.path.join(ROOT, "python", "kvevict")
PACKAGE = os.path.dirname(os.path.realpath(kvevict.__file__))


def test_imported_from_the_installed_package():
    assert PACKAGE != os.path.realpath(SOURCE), "kvevict was imported from the source tree, not the installed package"
    assert os.path.realpath(kvevict._kvevict.__file__).startswith(PACKAGE + os.sep)


def test_installed_sources_are_the_tree_s():
    stale = []
    for name in sorted(os.listdir(SOURCE)):
        if not (name.endswith((".py", ".pyi")) or name == "py.typed"):
            continue
        installed = os.path.join(PACKAGE, name)
        with open(os.path.join(SOURCE, name), "rb") as f:
            ours = f.read()
        if not os.path.exists(installed):
            stale.append(f"{name} (not installed)")
            continue
        with open(installed, "rb") as f:
            if f.read() != ours:
                stale.append(name)
    assert not stale, f"the kvevict installed in {PACKAGE} is not this tree's ({', '.join(stale)}): pip install . again"


def test_shipped_weights_are_in_the_package():
    assert os.path.dirname(os.path.realpath(models.WEIGHTS)) == PACKAGE
    with open(os.path.join(ROOT, "examples", "quality", "weights.pt.sha256")) as f:
        expected = f.read().split()[0]
    with open(models.WEIGHTS, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == expected


def test_version_is_version_hpp_s():
    with open(os.path.join(ROOT, "include", "kvevict", "version.hpp")) as f:
        parts = dict(re.findall(r"#define KVEVICT_VERSION_(MAJOR|MINOR|PATCH) (\d+)", f.read()))
    version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    assert kvevict.__version__ == version
    assert importlib.metadata.version("kvevict") == version
