"""The dtype the SGLang backend declares with its model id: the model
config's resolved dtype, with the weights' quantization."""

from types import SimpleNamespace

import torch

from cpcache.integrations.sglang.backend import model_dtype_of


def context(model_dtype=None, quantization=None, args_dtype="auto", args_quantization=None):
    config = None if model_dtype is None else SimpleNamespace(dtype=model_dtype, quantization=quantization)
    return SimpleNamespace(model_config=config,
                           server_args=SimpleNamespace(dtype=args_dtype, quantization=args_quantization))


def test_the_resolved_dtype_of_the_model_config():
    assert model_dtype_of(context(torch.float32)) == "float32"
    assert model_dtype_of(context(torch.bfloat16, args_dtype="auto")) == "bfloat16"


def test_weights_quantization_follows_the_dtype():
    assert model_dtype_of(context(torch.bfloat16, quantization="fp8")) == "bfloat16+fp8"
    assert model_dtype_of(context(torch.bfloat16, args_quantization="fp8")) == "bfloat16+fp8"


def test_without_a_model_config_the_server_args_say():
    assert model_dtype_of(context(args_dtype="float16")) == "float16"
    assert model_dtype_of(context(args_dtype="auto")) == "auto"
