"""What ``import kvevict`` imports (issue 38 item 1): the binding and the options, not the quality
model (``kvevict.models``), its installer or transformers, which load when first used."""

import subprocess
import sys

import pytest

import kvevict


def test_import_kvevict_leaves_the_quality_model_out(tmp_path):
    """``import kvevict`` imports neither ``kvevict.models`` (nor its installer, nor transformers);
    ``kvevict.models``, ``kvevict.install``, ``kvevict.press`` and ``kvevict.Installed`` import it
    when first used. In a fresh interpreter, outside the source tree."""
    code = "\n".join([
        "import sys",
        "import kvevict",
        "loaded = sorted(m for m in ('kvevict.models', 'kvevict._install', 'kvevict.hf', 'transformers')"
        " if m in sys.modules)",
        "assert not loaded, loaded",
        "assert {'models', 'install', 'press', 'Installed'} <= set(dir(kvevict))",
        "from kvevict import install",
        "assert 'kvevict.models' in sys.modules and install is kvevict.install and callable(kvevict.press)",
        "assert kvevict.models.Model.__module__ == 'kvevict.models' and kvevict.Installed.__name__ == 'Installed'",
        "print('ok')",
    ])
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvevict.nope
