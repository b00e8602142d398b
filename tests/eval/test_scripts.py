"""Command-line behaviour shared by the eval/ scripts, eval/harness.py suites and eval/compare.py tables."""

from __future__ import annotations

import ast
import json
import re

import pytest

from helm.evaluation import EvalError, run_script
from tests.eval.script_loader import EVAL_DIR, load_script

SCRIPTS = ["harness", "perplexity", "length_extrapolation", "pe_decay", "curvature", "compare"]


def test_eval_is_a_folder_of_independent_scripts():
    """No package (``eval`` is a builtin), no ``sys.path`` edits, no script importing another."""
    assert not (EVAL_DIR / "__init__.py").exists()
    assert sorted(p.stem for p in EVAL_DIR.glob("*.py")) == sorted(SCRIPTS)
    for path in [*EVAL_DIR.glob("*.py"), *EVAL_DIR.glob("tasks/*.py")]:
        tree = ast.parse(path.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {*SCRIPTS, "_shared", "eval", "local_data"}, path.name
        assert "sys.path" not in path.read_text(), path.name


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    script = load_script(name)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--" in out
    first_line = "".join(script.__doc__.split("\n")[0].split())
    assert first_line in "".join(out.split())  # the description is the docstring's first line


@pytest.mark.parametrize("name,argv", [
    ("perplexity", ["--model", "{missing}", "--files", "{text}"]),
    ("length_extrapolation", ["--model", "{missing}", "--files", "{text}"]),
    ("curvature", ["--model", "{missing}", "--files", "{text}", "--output-dir", "{tmp}"]),
    ("harness", ["--model", "{missing}", "--suite", "local"]),
])
def test_missing_checkpoint_is_a_clear_error(name, argv, tmp_path, text_file):
    values = {"missing": str(tmp_path / "no-such-checkpoint"), "text": str(text_file), "tmp": str(tmp_path / "o")}
    with pytest.raises(EvalError, match="--model '.*no-such-checkpoint'"):
        load_script(name).main([a.format(**values) for a in argv])


def test_folder_without_config_is_a_clear_error(tmp_path, text_file):
    with pytest.raises(EvalError, match=r"--model '.*': holds none of config\.json"):
        load_script("perplexity").main(["--model", str(tmp_path), "--files", str(text_file)])


def test_missing_text_file_is_a_clear_error(make_checkpoint, tmp_path):
    with pytest.raises(EvalError, match="text file not found: .*nope.jsonl"):
        load_script("curvature").main(["--model", str(make_checkpoint("helm_d")), "--files",
                                       str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path)])


def test_jsonl_without_the_text_field_names_the_fields(make_checkpoint, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(EvalError, match="text_column='text'.*body"):
        load_script("perplexity").main(["--model", str(make_checkpoint("helm_d")), "--files", str(bad)])


CURVATURE = ["--model", "{helm}", "--files", "{text}", "--output-dir", "{tmp}", "--no-progress"]


@pytest.mark.parametrize("name,argv,message", [
    ("perplexity", ["--model", "{helm}", "--files", "{text}", "--dtype", "float8"], "--dtype"),
    ("length_extrapolation", ["--model", "{helm}", "--files", "{text}", "--factors", "0", "2"], "--factors"),
    ("curvature", [*CURVATURE, "--max-points", "40", "--knn", "60"], "--knn must lie in"),
    ("curvature", [*CURVATURE, "--max-points", "40", "--alpha", "1"], "--alpha"),
    ("curvature", [*CURVATURE, "--max-points", "2"], "--max-points"),
    ("pe_decay", ["--head-dim", "15", "--output", "{tmp}/a.png"], "--head-dim"),
    ("harness", ["--model", "{helm}", "--tasks", "helm_local_mc", "--num-fewshot", "-1"], "--num-fewshot"),
])
def test_bad_arguments_are_clear_errors(name, argv, message, make_checkpoint, text_file, tmp_path, capsys):
    """Exit 2 and one error line naming the option, from the script's checks or argparse's types alike."""
    values = {"helm": str(make_checkpoint("helm_d")), "text": str(text_file), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        run_script(load_script(name).main, [a.format(**values) for a in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_harness_tasks_take_shots_and_a_limit(make_checkpoint, capsys):
    record = load_script("harness").main(["--model", str(make_checkpoint("helm_d")), "--tasks", "helm_local_mc",
                                          "--num-fewshot", "2", "--limit", "5", "--log-samples"])
    assert record["suite"] is None and record["n-shot"] == {"helm_local_mc": 2}
    assert record["n-samples"]["helm_local_mc"]["effective"] == 5
    [sample] = record["samples"]["helm_local_mc"][:1]
    assert sample["arguments"][0][0].count("Question:") == 3  # two shots and the question itself


def test_paper_suite_matches_the_table_of_the_readme():
    """Issue 12: each task of the paper suite with its shots and metric, as tabulated in eval/README.md."""
    harness = load_script("harness")
    readme = (EVAL_DIR / "README.md").read_text()
    rows = re.findall(r"^\| [^|`]+ \| `([a-z_]+)` \| (\d+) \| `([a-z_]+)` \|$", readme, flags=re.M)
    assert [(task, int(shots), metric) for task, shots, metric in rows] == harness.SUITES["paper"]
    assert harness.runs(harness.SUITES["paper"]) == [(["commonsense_qa", "hellaswag", "helm_openbookqa_letters"], 0),
                                                     (["mmlu", "arc_challenge"], 5)]


def test_openbookqa_is_scored_on_letter_choices():
    """The paper's conversion (App. C.3): answers listed as (A)-(D) under the question, the letters ranked."""
    import yaml
    from lm_eval.utils import apply_template

    text = (EVAL_DIR / "tasks" / "helm_openbookqa_letters.yaml").read_text()
    config = yaml.safe_load(text)
    doc = {"question_stem": "The sun is responsible for",
           "choices": {"text": ["puppies learning new tricks", "children growing up", "flowers wilting in a vase",
                                "plants sprouting"], "label": ["A", "B", "C", "D"]},
           "answerKey": "D "}
    assert apply_template(config["doc_to_text"], doc) == (
        "The sun is responsible for\n(A) puppies learning new tricks\n(B) children growing up\n"
        "(C) flowers wilting in a vase\n(D) plants sprouting\nAnswer:")
    assert apply_template(config["doc_to_choice"], doc) == "['A', 'B', 'C', 'D']"
    assert apply_template(config["doc_to_target"], doc) == "3"
    assert [m["metric"] for m in config["metric_list"]] == ["acc"]
    assert (config["dataset_path"], config["dataset_name"], config["test_split"]) == ("allenai/openbookqa", "main", "test")


def test_local_suite_result_feeds_compare(make_checkpoint, tmp_path, capsys):
    harness, compare = load_script("harness"), load_script("compare")
    out = tmp_path / "mice.json"
    record = harness.main(["--model", f"mice={make_checkpoint('helm_mice')}", "--suite", "local", "--batch-size", "4",
                           "--output", str(out)])
    assert set(record["results"]) >= {"helm_local_mc", "helm_local_ppl", "helm_local_gen"}
    assert record["n-shot"]["helm_local_mc"] == 0
    saved = json.loads(out.read_text())
    assert saved["model_name"] == "mice" and saved["suite"] == "local" and "samples" not in saved
    table = compare.main([str(out)])
    header, _, row = table.splitlines()
    assert "helm_local_mc (acc_norm, 0-shot)" in header and "helm_local_ppl (word_perplexity, 0-shot)" in header
    acc = 100 * saved["results"]["helm_local_mc"]["acc_norm,none"]
    assert row.startswith("| mice | ") and f"{acc:.1f}" in row


def lm_eval_record(name, accs, shots):
    results = {task: {"alias": task, "acc,none": a, "acc_stderr,none": 0.01, "acc_norm,none": a + 0.02,
                      "acc_norm_stderr,none": 0.02} for task, a in accs.items()}
    results["mmlu_anatomy"] = {"acc,none": 0.9, "acc_stderr,none": 0.05}  # a subtask: hidden under its group
    return {"model_name": f"/ckpts/{name}", "results": results, "n-shot": shots,
            "group_subtasks": {"mmlu": ["mmlu_stem"], "mmlu_stem": ["mmlu_anatomy"]},
            "config": {"model_args": f"pretrained=/ckpts/{name}"}}


def test_compare_builds_the_paper_table(tmp_path):
    compare = load_script("compare")
    shots = {"commonsense_qa": 0, "hellaswag": 0, "mmlu": 5}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results_1.json").write_text(json.dumps(
        lm_eval_record("helm-d", {"commonsense_qa": 0.20, "hellaswag": 0.30, "mmlu": 0.25}, shots)))
    (tmp_path / "b.json").write_text(json.dumps(
        lm_eval_record("llama", {"commonsense_qa": 0.22, "hellaswag": 0.28, "mmlu": 0.24}, shots)))
    (tmp_path / "ppl.json").write_text(json.dumps({"model_name": "helm-d", "results": {
        "perplexity:validation": {"perplexity": 12.3456, "mean_nll": 2.513, "scored_tokens": 100}}}))
    (tmp_path / "notes.json").write_text(json.dumps({"something": "else"}))
    table = compare.main([str(tmp_path), "--metric", "mmlu=acc"])
    lines = table.splitlines()
    assert lines[0] == ("| Model | commonsense_qa (acc_norm, 0-shot) | hellaswag (acc_norm, 0-shot) | "
                        "mmlu (acc, 5-shot) | perplexity:validation (perplexity) | Avg |")
    helm_row = next(line for line in lines if line.startswith("| helm-d |"))
    llama_row = next(line for line in lines if line.startswith("| llama |"))
    assert "| 22.0 | 32.0 | 25.0 |" in helm_row and "±" not in table
    assert "12.35" in helm_row and helm_row.endswith(f"| {(22 + 32 + 25) / 3:.1f} |")
    assert llama_row.split(" | ")[4] == "—"  # no perplexity file for llama
    assert "anatomy" not in table and "mmlu_stem" not in table


def test_compare_reads_multi_run_files_and_renames(tmp_path):
    compare = load_script("compare")
    runs = {"text": "x", "runs": [
        {"model_name": "hope", "results": {"length_extrapolation": {"ppl@1x": 10.0, "ppl@2x": 11.0}}},
        {"model_name": "learned", "results": {"length_extrapolation": {"ppl@1x": 9.0, "ppl@2x": None}}}]}
    (tmp_path / "ext.json").write_text(json.dumps(runs))
    single = tmp_path / "one.json"
    single.write_text(json.dumps({"results": {"t": {"acc,none": 0.5, "exact_match,strict-match": 0.25}}}))
    table = compare.main([str(tmp_path / "ext.json"), f"renamed={single}"])
    assert "| hope | 10 | 11 | — |" in table and "| learned | 9 | — | — |" in table
    assert "| renamed | — | — | 50.0 |" in table
    filtered = compare.main([str(single), "--metric", "t=exact_match (strict-match)"])
    assert "t (exact_match (strict-match))" in filtered and "| one | 25.0 |" in filtered
    with pytest.raises(EvalError, match="not found"):
        compare.main([str(tmp_path / "missing.json")])
    with pytest.raises(EvalError, match="TASK=METRIC"):
        compare.main([str(single), "--metric", "t"])
