"""The suite's MLA patch of torch_native (cpu_host/mla_torch_native.py) is
checked against a dense reference: a tp 1 `sglang.launch_server` with it,
and without cache, answers what transformers' own DeepSeek-V2 computes for
the same weights (greedy tokens; logprobs within float32 noise). The CP
suites' reference servers are such servers, so every MLA reply they check is
checked against transformers too. The prompts are long enough for several
pages, one runs a decode long enough to cross a page, and they are sent
at once, so prefills and decodes of several sequences share batches."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.servers import (
    MLA_ENV,
    PLAIN_FLAGS,
    SGLANG_PYTHON,
    Reply,
    Server,
    same_outputs,
    sglang_interpreter,
)
from tests.sglang.stacks import References

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

PROMPTS = [list(range(1, 40)), [(7 * i) % 500 + 1 for i in range(130)], [(11 * i) % 500 + 3 for i in range(75)]]
NEW_TOKENS = [6, 24, 10]

# transformers' own greedy generation, in SGLang's environment (which has it).
TRANSFORMERS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
replies = []
for ids, new in json.loads(sys.argv[2]):
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    replies.append([tokens, [torch.log_softmax(l[0], -1)[t].item() for l, t in zip(out.logits, tokens)]])
print(json.dumps(replies))
"""


def test_mla_in_torch_native_answers_what_transformers_computes(tmp_path: Path, references: References):
    model = references.model("deepseek_v2")  # the session's (seeded): the one the MLA stacks serve
    done = subprocess.run([sglang_interpreter(), "-c", TRANSFORMERS, str(model),
                           json.dumps(list(zip(PROMPTS, NEW_TOKENS)))],
                          capture_output=True, text=True, timeout=300, check=True)
    dense = [Reply(tuple(tokens), tuple(logprobs), 0, 0, 0, 0, "")
             for tokens, logprobs in json.loads(done.stdout.strip().splitlines()[-1])]
    server = Server("mla-tp1", model, tmp_path, PLAIN_FLAGS, env=MLA_ENV)
    try:
        server.start().wait_ready()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda job: server.generate(job[0], max_new_tokens=job[1]),
                                    zip(PROMPTS, NEW_TOKENS)))
        for got, want in zip(replies, dense):
            assert same_outputs(got, want), f"SGLang answered {got}, transformers {want}"
        assert server.log_lines("MLA's ragged prefill"), "the patch did not run"
    finally:
        server.stop()
