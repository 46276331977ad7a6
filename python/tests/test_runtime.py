"""One Python runtime under both installers (issue 38 item 1): ``kvevict.EvictionConfig`` is the
only list of options and defaults, checked and its C++ options built once; ``kvevict.install``,
``kvevict.press`` and ``kvevict.hf`` take it; ``import kvevict`` leaves the quality model out.
(What the runtime computes is checked through the adapters: test_install.py, test_model.py
against the C++ model, test_hf.py against transformers.)"""

import copy
import dataclasses
import inspect
import pickle
import subprocess
import sys

import pytest

import kvevict
from kvevict.config import EvictionConfig

SEED_ARGS = ("budget", "n_sink", "n_recent")  # positional in every installer (the seed's call)


def installers():
    out = [kvevict.install, kvevict.press]
    try:
        from kvevict import hf
    except ImportError:  # no transformers: the [hf] extra
        return out
    return out + [hf.install_kv_eviction, hf.press]


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


@pytest.mark.parametrize("fn", installers(), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_installer_takes_the_options_and_defaults_of_evictionconfig(fn):
    """No installer lists an option of its own: budget, n_sink and n_recent default to the
    config's, every other field is a keyword argument that the config checks (the presses' own
    `scorer` is the press's scorer, SnapKV by default, not the field)."""
    fields = {f.name: f.default for f in dataclasses.fields(EvictionConfig)}
    params = inspect.signature(fn).parameters
    assert [params[n].default for n in SEED_ARGS] == [fields[n] for n in SEED_ARGS]
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert set(params) & (set(fields) - set(SEED_ARGS)) == ({"scorer"} if fn.__name__ == "press" else set())


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


def test_unknown_options_are_refused_by_name():
    from kvevict.models import Config, Model
    model = Model(Config(n_layers=1))
    with pytest.raises(TypeError, match=r"kvevict: install got unknown options \['bogus'\]; known: \["):
        kvevict.install(model, bogus=1)
    with pytest.raises(TypeError, match=r"kvevict: press got unknown options \['compress'\]"):
        with kvevict.press(model, compress=kvevict.SnapKV(4, 3)):
            pass
    assert "forward" not in model.blocks[0].attn.__dict__


def test_the_config_checks_once_and_builds_its_options_once():
    """The C++ EvictionOptions are built and validated when the config is made (capacity 0 is
    refused there), then shared: the same object on every read. Copies and pickles of the config
    work (they build their own); an assigned field builds them again."""
    c = EvictionConfig(budget=8, n_sink=2, n_recent=4, evict_every=2)
    ev = c.eviction_options
    assert ev is c.eviction_options
    assert repr(ev) == "EvictionOptions(budget=8, n_sink=2, n_recent=4, evict_every=2)"
    for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c)), dataclasses.replace(c)):
        assert other == c and repr(other.eviction_options) == repr(ev)
    c.budget = 16
    assert repr(c.eviction_options) == "EvictionOptions(budget=16, n_sink=2, n_recent=4, evict_every=2)"
    with pytest.raises(ValueError, match="capacity = n_sink \\+ budget \\+ n_recent must be >= 1"):
        EvictionConfig(budget=0, n_sink=0, n_recent=0)
    with pytest.raises(ValueError, match=r"layout must be one of \('latent', 'expanded'\), got 'paged'"):
        EvictionConfig(layout="paged")


def test_remove_puts_back_a_forward_set_on_the_instance_before_install():
    """Removal is the runtime's for both installers: an attention module's own instance-level
    forward, set before install, is there again after remove() (it was dropped by install's
    remove before)."""
    from kvevict.models import Config, Model
    model = Model(Config(n_layers=2))
    attn = model.blocks[1].attn
    plain = attn.forward

    def own(x, pos, mask):
        return plain(x, pos, mask)

    attn.forward = own
    kv = kvevict.install(model)
    assert attn.forward is not own and model._kvevict_installed is kv
    kv.remove()
    kv.remove()  # idempotent
    assert attn.__dict__["forward"] is own and "forward" not in model.blocks[0].attn.__dict__
    assert not hasattr(model, "_kvevict_installed")


def test_the_press_warning_points_at_the_callers_with():
    from kvevict.models import Config, Model
    with pytest.warns(UserWarning, match=r"SnapKV window \(8\) is longer than n_recent \(4\)") as record:
        with kvevict.press(Model(Config(n_layers=1)), budget=8, n_sink=2, n_recent=4, window=8):
            pass
    assert record[0].filename == __file__


def test_eviction_config_bounds_recall_settings_as_the_cpp_does():
    from kvevict import EvictionConfig
    with pytest.raises(ValueError, match=r"recall_tokens must be in \[0, 2\^40\]"):
        EvictionConfig(recall_tokens=2 ** 41)
    with pytest.raises(ValueError, match=r"tier_page_size must be an int in \[1, 2\^40\]"):
        EvictionConfig(tier_page_size=2 ** 41)
    # rescore <= tokens: whole pages, whatever the page size; two-level needs a whole page
    EvictionConfig(tier_tokens=64, tier_page_size=16, recall_tokens=8, recall_rescore=4)
    with pytest.raises(ValueError, match="recall_rescore must be <= recall_tokens"):
        EvictionConfig(tier_tokens=64, tier_page_size=16, recall_tokens=8, recall_rescore=12)
