"""lm-evaluation-harness on saved micro HELM checkpoints, offline, with the local tasks in eval/tasks/.

* Python API: ``lm_eval.simple_evaluate`` with the stock ``HFLM``, once from a model object at batch size 1
  and once from the saved folder (``pretrained=DIR``) at batch size 4: every per-document result must agree
  (right padding of log-likelihood batches, left padding of generation batches).
* CLI: the stock ``python -m lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`` in a
  fresh process whose working directory is *not* the repository (so the task data must resolve relative
  to the task files). When the saved folder carries remote code (``auto_map`` in config.json), a stand-in
  ``helm`` package that refuses to import shadows the installed one, so the model can only load through
  the saved code; without remote code a ``sitecustomize`` shim on ``PYTHONPATH`` does ``import helm``
  (which registers the Auto classes) and the command line is otherwise unchanged.
* Consistency: the log-likelihood lm-eval reports for (context, continuation) pairs equals a direct
  computation from the model's logits, and its rolling log-likelihood equals helm.evaluation's windows.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

from helm.evaluation import rows_nll, sliding_windows
from tests.eval.script_loader import REPO, TASK_DIR, load_script

TASKS = ["helm_local_mc", "helm_local_ppl", "helm_local_gen"]
KINDS = ["helm_d", "helm_mice"]


def hflm(pretrained, tokenizer=None, batch_size=1):
    return HFLM(pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, device="cpu",
                trust_remote_code=True)


@functools.cache
def task_manager():
    """One TaskManager for the module: indexing lm-eval's built-in tasks takes seconds."""
    return TaskManager(include_path=str(TASK_DIR))


def run_api(lm, tasks=TASKS):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(), log_samples=True)


def per_document(samples: dict) -> dict:
    """``{task: {doc_id: response}}``: log-likelihoods (mc, ppl) or generated strings (gen)."""
    out = {}
    for task, docs in samples.items():
        out[task] = {}
        for doc in docs:
            resp = doc["filtered_resps"]
            if task == "helm_local_mc":
                resp = [float(r[0]) for r in resp]
            elif task == "helm_local_ppl":
                resp = float(resp[0] if isinstance(resp, list) else resp)
            else:
                resp = resp[0] if isinstance(resp, list) else resp
            out[task][doc["doc_id"]] = resp
    return out


def assert_same_documents(a: dict, b: dict, *, atol=2e-4):
    assert a.keys() == b.keys()
    for task in a:
        assert a[task].keys() == b[task].keys(), task
        for doc_id, x in a[task].items():
            y = b[task][doc_id]
            if isinstance(x, str):
                assert x == y, (task, doc_id, x, y)
            else:
                assert torch.allclose(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                      atol=atol, rtol=1e-5), (task, doc_id, x, y)


@pytest.fixture(scope="module")
def api_results(make_checkpoint):
    """``{kind: (result at batch size 1 from the model object, result at batch size 4 from pretrained=DIR)}``."""
    out = {}
    for kind in KINDS:
        folder = make_checkpoint(kind)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        one = run_api(hflm(model, tokenizer, batch_size=1))
        four = run_api(hflm(str(folder), batch_size=4))
        out[kind] = (one, four)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_python_api_batch_size_1_and_4_agree(api_results, kind):
    one, four = api_results[kind]
    for result in (one, four):
        assert result["n-samples"]["helm_local_mc"]["effective"] == 16
        assert result["n-samples"]["helm_local_ppl"]["effective"] == 6
        assert result["n-samples"]["helm_local_gen"]["effective"] == 6
    docs1, docs4 = per_document(one["samples"]), per_document(four["samples"])
    assert_same_documents(docs1, docs4)
    for metric in ("acc,none", "acc_norm,none"):
        assert one["results"]["helm_local_mc"][metric] == four["results"]["helm_local_mc"][metric]
    ppl1, ppl4 = (r["results"]["helm_local_ppl"]["byte_perplexity,none"] for r in (one, four))
    assert math.isclose(ppl1, ppl4, rel_tol=1e-5)
    # byte perplexity is exp(-total log-likelihood / total UTF-8 bytes) over the six paragraphs
    docs = {doc["doc_id"]: doc["doc"]["text"] for doc in one["samples"]["helm_local_ppl"]}
    n_bytes = sum(len(text.encode("utf-8")) for text in docs.values())
    assert math.isclose(ppl1, math.exp(-sum(docs1["helm_local_ppl"].values()) / n_bytes), rel_tol=1e-6)
    assert any(text.strip() for text in docs1["helm_local_gen"].values())


def _stock_cli_env(folder, offline_env, tmp_path):
    """Environment for ``python -m lm_eval``: untouched if the checkpoint has remote code, else an import shim."""
    env = dict(offline_env)
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules-cache")
    config = json.loads((folder / "config.json").read_text())
    shim = tmp_path / "shim"
    shim.mkdir()
    if "auto_map" in config:
        # a stand-in ``helm`` package that refuses to import shadows the installed one: the process can only
        # load the checkpoint through the code saved next to it
        (shim / "helm").mkdir()
        (shim / "helm" / "__init__.py").write_text(
            "raise ImportError('this lm_eval process must load the checkpoint through its remote code alone')\n")
        env["PYTHONPATH"] = str(shim)
        return env, True
    (shim / "sitecustomize.py").write_text("import helm  # registers the HELM model types with the Auto classes\n")
    env["PYTHONPATH"] = f"{shim}:{env['PYTHONPATH']}"
    return env, False


def test_stock_cli_offline_matches_python_api(make_checkpoint, api_results, offline_env, tmp_path):
    """Both checkpoints through the stock CLI (run concurrently), compared document by document with the API."""
    procs = {}
    for kind in KINDS:
        folder = make_checkpoint(kind)
        work = tmp_path / kind
        work.mkdir()
        env, remote = _stock_cli_env(folder, offline_env, work)
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
               "--model_args", f"pretrained={folder},trust_remote_code=True", "--tasks", "helm_local",
               "--include_path", str(TASK_DIR), "--batch_size", "4", "--device", "cpu",
               "--output_path", str(work / "out"), "--log_samples"]
        procs[kind] = (subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True), work, remote)
    for kind, (proc, work, remote) in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{kind} (remote code: {remote}):\n{output[-4000:]}"
        [results_file] = list((work / "out").rglob("results_*.json"))
        result = json.loads(results_file.read_text())
        samples = {}
        for task in TASKS:
            [file] = list((work / "out").rglob(f"samples_{task}_*.jsonl"))
            samples[task] = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        one, _ = api_results[kind]
        assert_same_documents(per_document(one["samples"]), per_document(samples))
        assert result["results"]["helm_local_mc"]["acc,none"] == one["results"]["helm_local_mc"]["acc,none"]
        assert "helm_local_mc" in output  # the results table was printed


PAIRS = [
    ("Question: Which season usually follows winter?\nAnswer:", " spring"),
    ("one two three", " four five six"),
    ("the river flows under the stone", " bridge and then the rain falls over the green tree house."),
    ("", "the cat sits near the water."),
    ("a", " dog"),
]


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice", "llama"])
def test_loglikelihood_equals_direct_computation(make_checkpoint, kind):
    folder = make_checkpoint(kind)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    lm = hflm(model, tok, batch_size=4)  # pairs of different lengths share batches: right padding
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)]
    reported = lm.loglikelihood(requests)
    for (context, continuation), (loglik, greedy) in zip(PAIRS, reported, strict=True):
        cont_ids = tok(continuation, add_special_tokens=False)["input_ids"]
        ctx_ids = tok(context, add_special_tokens=False)["input_ids"] if context else [tok.eos_token_id]
        if context:  # the pairs are chosen so that tokenizing the joined text splits at the boundary
            assert tok(context + continuation, add_special_tokens=False)["input_ids"] == ctx_ids + cont_ids
        ids = torch.tensor([ctx_ids + cont_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        positions = range(len(ctx_ids) - 1, ids.shape[1] - 1)
        direct = sum(float(logprobs[p, ids[0, p + 1]]) for p in positions)
        direct_greedy = all(int(logprobs[p].argmax()) == int(ids[0, p + 1]) for p in positions)
        assert abs(loglik - direct) <= 1e-4, (context, continuation, loglik, direct)
        assert greedy == direct_greedy


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice"])
def test_rolling_loglikelihood_equals_perplexity_windows(make_checkpoint, text_file, kind):
    """lm-eval's rolling windows (max length L, one token of context) are ``sliding_windows`` of L + 1 tokens
    with stride L over ``[eos] + text``; on a text of exactly 2L tokens both score the same tokens with the
    same contexts, so the totals must agree."""
    folder = make_checkpoint(kind)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    length = model.config.max_position_embeddings
    texts = [json.loads(line)["text"] for line in text_file.read_text().splitlines()]
    ids = tok(" ".join(texts), add_special_tokens=False)["input_ids"][: 2 * length]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids  # the cut text tokenizes back to 2L tokens
    lm = hflm(model, tok, batch_size=2)
    assert lm.max_length == length
    [rolling] = lm.loglikelihood_rolling([Instance(request_type="loglikelihood_rolling", doc={},
                                                   arguments=(text,), idx=0)])
    stream = torch.tensor([tok.eos_token_id] + ids)
    nll, count = rows_nll(model, sliding_windows(stream, length + 1, length), batch_size=2)
    assert int(count) == len(ids)
    assert abs(rolling + float(nll)) <= 1e-3 * max(1.0, float(nll) / 100)


def test_local_task_data_resolves_relative_to_the_task_folder(tmp_path, monkeypatch):
    """The loader named in the task YAMLs finds its files from any working directory, and says which is missing."""
    monkeypatch.chdir(tmp_path)
    local_data = load_script("tasks/local_data")
    data = local_data.load(data_files={"test": "jsonl/helm_local_mc.jsonl"}, version=1.0, pretrained="ignored")
    assert len(data["test"]) == 16
    assert set(data["test"][0]) >= {"question", "choices", "label"}
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        local_data.load(data_files={"test": "jsonl/nope.jsonl"})


def test_local_task_files_are_not_git_ignored():
    """The task data must reach a fresh clone (a folder named ``data/`` would be ignored by .gitignore)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = sorted(p.relative_to(REPO).as_posix() for p in TASK_DIR.rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts)
    assert any(f.endswith(".jsonl") for f in files) and any(f.endswith(".yaml") for f in files)
    ignored = subprocess.run(["git", "check-ignore", *files], cwd=REPO, capture_output=True, text=True, check=False)
    assert ignored.stdout.strip() == "", f"git ignores: {ignored.stdout}"
