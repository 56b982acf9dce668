"""The test kit's servers import only the SGLang model modules of their
model's architectures (cpu_host/model_modules.py), on stand-in module files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from cpcache.testing.sglang_cpu.servers import CPU_HOST, model_modules_env

spec = importlib.util.spec_from_file_location("model_modules", CPU_HOST / "model_modules.py")
assert spec is not None and spec.loader is not None
model_modules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model_modules)


def models_dir(tmp_path: Path) -> Path:
    files = {"__init__.py": "", "llama.py": "class LlamaForCausalLM(nn.Module):\n    pass\n",
             "llama_eagle.py": "class LlamaForCausalLMEagle(LlamaForCausalLM):\n    pass\n",
             "qwen3.py": "from sglang.srt.models.qwen2 import Qwen2Model\nclass Qwen3ForCausalLM(nn.Module):\n",
             "qwen2.py": "class Qwen2Model(nn.Module):\n", "transformers.py": "class TransformersForCausalLM:\n",
             "deepseek_v2.py": "class DeepseekV2ForCausalLM(nn.Module):\nclass DeepseekV3ForCausalLM(D):\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_every_module_but_those_defining_the_architectures_and_the_fallback_is_skipped(tmp_path: Path):
    models = models_dir(tmp_path)
    assert model_modules.disabled(models, ["Qwen3ForCausalLM"]) == ["deepseek_v2", "llama", "llama_eagle", "qwen2"]
    # qwen2 is skipped by the registry's walk only: qwen3's own import still loads it
    assert model_modules.disabled(models, ["DeepseekV3ForCausalLM", "LlamaForCausalLM"]) == \
        ["llama_eagle", "qwen2", "qwen3"]


def test_an_architecture_defined_nowhere_skips_nothing(tmp_path: Path):
    models = models_dir(tmp_path)
    assert model_modules.disabled(models, ["Qwen3ForCausalLM", "SomeAliasForCausalLM"]) is None
    assert model_modules.disabled(models, []) is None


def test_a_server_names_its_models_architectures_and_nothing_without_a_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    assert model_modules_env(tmp_path) == {"CPCACHE_TEST_MODEL_ARCHS": "Qwen3ForCausalLM"}
    assert model_modules_env(tmp_path / "missing") == {}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": "Qwen3ForCausalLM"}))
    assert model_modules_env(tmp_path) == {}
