"""One Python face for both installers (issue 38 item 1): ``import kvevict`` leaves the quality
model (``kvevict.models``), its installer and transformers out until first used; the installers
share ``EvictionConfig``'s defaults."""

import subprocess
import sys

import pytest

import kvevict
from kvevict.config import EvictionConfig


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


def test_install_defaults_to_the_latent_layout():
    """The layout default is EvictionConfig's, "latent", for kvevict.install as for kvevict.hf (it
    was "expanded" for install before the runtime was shared)."""
    from kvevict.models import Config, Model
    kv = kvevict.install(Model(Config(n_layers=2)))
    try:
        assert EvictionConfig().layout == "latent" and kv.layout == "latent"
        assert isinstance(kv.cache, kvevict.MlaLatentCache)
    finally:
        kv.remove()
