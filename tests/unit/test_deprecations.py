"""Old names keep working, each with a DeprecationWarning naming what to
type instead (cpcache.deprecations). SGLang's own loader taking the storage
backend by its old class name: tests/sglang/test_decode_store.py."""

import json
import types
import warnings

import pytest

from cpcache.deprecations import renamed_attributes
from cpcache.integrations.sglang.settings import Settings


def module_with_a_renamed_class() -> types.ModuleType:
    module = types.ModuleType("plugin")

    class New:
        pass

    module.New = New
    module.__getattr__ = renamed_attributes("plugin", vars(module), {"Old": "New"}, hint=" (say {new})")
    return module


def test_an_old_name_resolves_to_the_new_one_with_a_warning_naming_it(caplog):
    module = module_with_a_renamed_class()
    with pytest.warns(DeprecationWarning, match=r"plugin\.Old is deprecated; it is now plugin\.New \(say New\)"):
        assert getattr(module, "Old") is module.New  # noqa: B009  (as a dynamic loader takes it)
    assert "plugin.Old is deprecated" in caplog.text  # servers do not show DeprecationWarnings: logged too


def test_the_new_name_does_not_warn_and_an_unknown_one_is_not_found():
    module = module_with_a_renamed_class()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert module.New.__name__ == "New"
        with pytest.raises(AttributeError, match="has no attribute 'Other'"):
            getattr(module, "Other")  # noqa: B009
    assert not hasattr(module, "Other")


def test_a_retired_backend_setting_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "sglang-cpcache.json"
    path.write_text(json.dumps({"model_id": "m", "shm_dir": "/dev/shm"}))
    with pytest.warns(DeprecationWarning, match="setting shm_dir is deprecated and ignored: the pools are handed"):
        assert Settings.load(str(path)) == Settings(model_id="m")


def test_an_unknown_backend_setting_is_still_refused(tmp_path):
    path = tmp_path / "sglang-cpcache.json"
    path.write_text(json.dumps({"shm_dri": "/dev/shm"}))
    with pytest.raises(ValueError, match="unknown settings shm_dri"):
        Settings.load(str(path))
