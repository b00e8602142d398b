#!/usr/bin/env bash
# Check one set of dependency versions against the zoo: a fresh virtualenv, the pinned versions installed, helm
# installed from a source tree without its dependencies, then a smoke test that prints PASS or FAIL per step.
# docs/dependencies.md records the floors this found and what broke below each. Not run by CI: it installs from
# the package index and takes minutes.
#
#   scripts/check_dependency_floors.sh [--venv DIR] [--src DIR] [--keep] [PKG==VERSION ...]
#
#   --venv DIR   the virtualenv to create (default: a new folder under /tmp); an existing one is reused, so
#                several candidate sets can be tried in one venv by reinstalling pins
#   --src DIR    the helm source tree to install (default: this checkout). A `git worktree` of a commit keeps the
#                check away from half-finished edits
#   --keep       keep a venv the script created (one given with --venv is always kept)
#   PKG==VERSION the versions under test, e.g. transformers==5.0.0 peft==0.18.0 torch==2.13.0. Every dependency of
#                pyproject.toml (and peft) not pinned here is installed as pyproject bounds it, at pip's choice.
#
# Steps: import (import helm, no private transformers name needed), per family (helm_d, helm_mice): build, save,
# reload with AutoModelForCausalLM.from_pretrained and the same logits, generate; remote-code (the saved folders
# loaded with trust_remote_code=True in a child process that cannot import helm, generating the same tokens);
# peft (LoRA get_peft_model with HELM's default targets, forward and backward, adapter saved and
# reloaded by PeftModel.from_pretrained and model.load_adapter); data (helm.data trains a tokenizer through datasets and
# tokenizers, AutoTokenizer reloads it); train (train.py, through accelerate, 4 steps with checkpoints,
# final/ reloaded); recipe (OmegaConf reads configs/train/tiny-helm-d.yaml); pip-check
# (the installed set satisfies pyproject's bounds). Exit status: the number of failed steps.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$here"
venv=""
keep=0
pins=()
while (($#)); do
    case "$1" in
        --venv) venv="$2"; keep=1; shift 2 ;;
        --src) src="$(cd "$2" && pwd)"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *==*) pins+=("$1"); shift ;;
        *) echo "check_dependency_floors.sh: $1: expected PKG==VERSION or an option (--help)" >&2; exit 2 ;;
    esac
done
[[ -f "$src/pyproject.toml" ]] || { echo "check_dependency_floors.sh: --src $src: no pyproject.toml there" >&2; exit 2; }
if [[ -z "$venv" ]]; then
    venv="$(mktemp -d /tmp/helm-floors.XXXXXX)"
fi
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" || exit 2
venv="$(cd "$venv" && pwd)"
[[ $keep == 1 ]] || trap 'rm -rf "$venv"' EXIT
py="$venv/bin/python"
# (the grep drops pip's warnings about this machine's local index folders, which list only some packages)
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# torch first, on its own: installed alongside the rest, an unpinned torch would be resolved to the newest build
torch_pin=(torch)
rest=()
for pin in "${pins[@]}"; do
    if [[ "${pin%%==*}" == torch ]]; then torch_pin=("$pin"); else rest+=("$pin"); fi
done
# pyproject's dependencies plus peft, each replaced by its pin when one is given
mapfile -t requirements < <("$py" - "$src/pyproject.toml" "${rest[@]}" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = {re.split(r"[=<>!~ \[]", p)[0].lower(): p for p in sys.argv[2:]}
wanted = project["dependencies"] + [r for r in project["optional-dependencies"]["test"] if r.startswith("peft")]
names = set()
for requirement in wanted:
    name = re.split(r"[=<>!~ \[;]", requirement)[0].lower()
    names.add(name)
    print(pins.get(name, requirement))
for name, pin in pins.items():
    if name not in names:
        print(pin)
EOF
)

pip_install "${torch_pin[@]}" || { echo "FAIL install ${torch_pin[*]}"; exit 1; }
pip_install "${requirements[@]}" || { echo "FAIL install ${requirements[*]}"; exit 1; }
pip_install --no-deps -e "$src" || { echo "FAIL install helm from $src"; exit 1; }
echo "versions: $("$py" -c 'import importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in
    ("torch", "transformers", "peft", "accelerate", "geoopt", "safetensors", "tokenizers", "datasets",
     "huggingface_hub", "omegaconf")))')"

work="$(mktemp -d /tmp/helm-floors-run.XXXXXX)"
# run in $work, without PYTHONPATH: the helm imported is the one installed from --src, never a checkout in the
# current folder
cd "$work" && env -u PYTHONPATH HF_HOME="$work/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1 "$py" - "$src" "$work" <<'EOF'
import importlib.util, json, os, subprocess, sys, textwrap, traceback
from pathlib import Path

src, work = Path(sys.argv[1]), Path(sys.argv[2])
failures = 0
print("helm from", importlib.util.find_spec("helm").origin, flush=True)


def step(name, fn):
    """Run ``fn``; print ``PASS name`` or ``FAIL name`` with the error's last traceback lines."""
    global failures
    try:
        fn()
        print(f"PASS {name}", flush=True)
        return True
    except Exception:  # noqa: BLE001 - every failure is reported and counted, then the next step runs
        failures += 1
        print(f"FAIL {name}\n" + textwrap.indent("".join(traceback.format_exc().splitlines(True)[-6:]), "    "),
              flush=True)
        return False


# the same tiny shapes as tests/helpers.py
SHAPES = {
    "helm_d": dict(num_hidden_layers=2, hidden_size=33, num_attention_heads=2, intermediate_size=65),
    "helm_mice": dict(num_hidden_layers=2, hidden_size=33, num_attention_heads=2, intermediate_size=65,
                      moe_intermediate_size=33, kv_lora_rank=17, qk_nope_head_dim=9, qk_rope_head_dim=9,
                      v_head_dim=9),
}
PRESETS = {"helm_d": "tiny-helm-d", "helm_mice": "tiny-helm-mice"}
generated = {}


def import_helm():
    global helm, torch, AutoModelForCausalLM
    import torch
    import helm
    from transformers import AutoModelForCausalLM


def family_steps(family):
    folder = work / family
    state = {}

    def build():
        torch.manual_seed(0)
        config = helm.load_config(PRESETS[family], vocab_size=512, max_position_embeddings=128, **SHAPES[family])
        state["model"] = AutoModelForCausalLM.from_config(config).eval()

    def save():
        state["model"].save_pretrained(folder)

    def reload():
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            before, after = state["model"](ids).logits, loaded(ids).logits
        assert torch.equal(before, after), f"reloaded logits differ by {(before - after).abs().max()}"
        state["loaded"] = loaded

    def generate():
        out = state["loaded"].generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 7), out.shape
        generated[family] = out.tolist()

    for name, fn in (("build", build), ("save", save), ("reload", reload), ("generate", generate)):
        if not step(f"{family} {name}", fn):
            return


def remote_code():
    child = textwrap.dedent(f"""
        import sys, importlib.abc
        class NoHelm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "helm" or name.startswith("helm."):
                    raise ImportError("helm is not installed here")
        sys.meta_path.insert(0, NoHelm())
        import json, torch
        from transformers import AutoModelForCausalLM
        out = {{}}
        for family in ("helm_d", "helm_mice"):
            model = AutoModelForCausalLM.from_pretrained({str(work)!r} + "/" + family, trust_remote_code=True)
            out[family] = model.eval().generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).tolist()
        assert "helm" not in sys.modules
        print("GENERATED", json.dumps(out))
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(work / "modules")}
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=work, env=env,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.split("GENERATED ")[-1])
    assert out == generated, f"remote code generated {out}, helm {generated}"


def lora():
    """LoRA on helm_d with PEFT's default targets for HELM (no target_modules given): forward, backward, the
    adapter saved, then loaded onto a fresh base by PEFT and by the model's load_adapter, with the same logits."""
    import peft
    model = AutoModelForCausalLM.from_pretrained(work / "helm_d")
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, init_lora_weights=False))
    ids = torch.tensor([[1, 2, 3, 4]])
    adapted(ids, labels=ids).loss.backward()
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained), trained
    assert all(p.grad is not None for p in adapted.parameters() if p.requires_grad)
    adapted.save_pretrained(work / "adapter")
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "helm_d"), work / "adapter")
    onto = AutoModelForCausalLM.from_pretrained(work / "helm_d")
    onto.load_adapter(str(work / "adapter"))  # HELM's override, then transformers' PEFT integration
    with torch.no_grad():
        expected = adapted.eval()(ids).logits
        assert torch.equal(loaded.eval()(ids).logits, expected)
        assert torch.equal(onto.eval()(ids).logits, expected)


def data():
    from transformers import AutoTokenizer
    from helm.data.tokenizer import train_tokenizer
    words = "the a one two red blue cat dog bird river stone tree runs sits sings flows over under and then".split()
    texts = work / "text"
    texts.mkdir()
    for split, rows in (("train", 64), ("validation", 8)):
        lines = (json.dumps({"text": " ".join(words[(i * j) % len(words)] for j in range(40))}) for i in range(rows))
        (texts / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    train_tokenizer(texts / "train.jsonl", work / "tokenizer", vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    text = "the river runs"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def train():
    """train.py (accelerate's Accelerator, checkpoints and tracker) for 4 steps on the data step's corpus and
    tokenizer, then final/ reloaded."""
    shapes = dict(SHAPES["helm_d"], num_hidden_layers=1, vocab_size=320, max_position_embeddings=64)
    options = [f"--model.overrides.{k}={v}" for k, v in shapes.items()] + [
        f"--data.dataset={work / 'text'}", f"--data.tokenizer={work / 'tokenizer'}", "--data.build_default=false",
        "--data.seq_len=32", f"--train.output_dir={work / 'run'}", "--train.max_steps=4", "--train.batch_size=2",
        "--train.eval_every=0", "--train.eval_rows=4", "--train.save_every=2", "--demo.max_new_tokens=4"]
    proc = subprocess.run([sys.executable, str(src / "train.py"), "--config", str(src / "configs/train/tiny-helm-d.yaml"),
                           *options], capture_output=True, text=True, cwd=work, stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    AutoModelForCausalLM.from_pretrained(work / "run" / "final")


def recipe():
    from helm.training.config import load_run_config
    config = load_run_config(src / "configs/train/tiny-helm-d.yaml", ["optim.lr=1e-3"])
    assert config.optim.lr == 1e-3


if step("import", import_helm):
    for family in ("helm_d", "helm_mice"):
        family_steps(family)
    if len(generated) == 2:
        step("remote-code", remote_code)
    if (work / "helm_d" / "config.json").exists():
        step("peft", lora)
    if step("data", data):
        step("train", train)
    step("recipe", recipe)
sys.exit(failures)
EOF
failed=$?
cd / && rm -rf "$work"
if "$py" -m pip check >/dev/null 2>&1; then echo "PASS pip-check"; else
    echo "FAIL pip-check"; "$py" -m pip check | sed 's/^/    /'; failed=$((failed + 1)); fi
echo "$([[ $failed == 0 ]] && echo PASS || echo FAIL) all ($failed failed)"
exit "$failed"
