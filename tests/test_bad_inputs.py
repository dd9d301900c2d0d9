"""Bad input, as a user types it, against the real CLI: exit 2, one message naming the field and the
bad value, no traceback, and nothing written to the output path (issue 14).

Every case fails at validation, before any model is built or compiled, so the whole matrix runs in
seconds. A case is the command line, the files it reads (written under tmp_path first), an optional
command that must succeed beforehand (e.g. registering a spec), the output path that must be left
alone, and the texts the message must contain.
"""

from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from helpers import run_cli
from moelab import presets
from moelab.config import dump_yaml, override

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "experiments" / "demo-spec.yaml").read_text()
PLAN = (ROOT / "experiments" / "plan.yaml").read_text()
DIRECTORY = object()  # a files-entry that is made as a directory
OUT = "{tmp}/out"


class Case(NamedTuple):
    args: list[str]
    expected: list[str]  # substrings of the message: the field (or flag / file) and the bad value
    files: dict = {}  # name under tmp_path -> text, or DIRECTORY
    before: list[str] | None = None  # a command that must exit 0 first
    out: str | None = OUT  # must not appear, or stay byte-for-byte unchanged if `files` created it


def train_yaml(config: str, *expected: str, files: dict | None = None) -> Case:
    """`moelab train run.yaml` with `config` as the YAML text (and more `files` beside it)."""
    return Case(["train", "{tmp}/run.yaml", "--out", OUT], list(expected), {"run.yaml": config, **(files or {})})


def train_set(setting: str, *expected: str) -> Case:
    return Case(["train", "--preset", "tiny", "--set", setting, "--out", OUT], list(expected))


def train_mesh(mesh: str, *expected: str) -> Case:
    return Case(["train", "--preset", "tiny", "--mesh", mesh, "--out", OUT], list(expected))


def own_data(paths: str, *expected: str, files: dict | None = None) -> Case:
    """A run on the user's own files only (no embedded domain), so a data error comes before any tokenizing."""
    config = ("data:\n  domains:\n    - {name: mine, kind: files, paths: [" + paths + "]}\n"
              "  phases:\n    - {name: all, fraction: 1.0, weights: {mine: 1.0}}\n")
    return train_yaml(config, *expected, files=files)


def spec(text: str, *expected: str) -> Case:
    """`moelab lab register` of a spec; the ledger's folder must not be created."""
    return Case(["lab", "register", "{tmp}/spec.yaml", "--ledger", "{tmp}/lab/ledger.sqlite"], list(expected),
                {"spec.yaml": text}, out="{tmp}/lab")


def spec_with(edit: dict, *expected: str) -> Case:
    data = yaml.safe_load(SPEC)
    for key, value in edit.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return spec(yaml.safe_dump(data), *expected)


def ladder_fit(curves: str, target: str, *expected: str) -> Case:
    return Case(["ladder", "fit", "--curves", "{tmp}/curves.csv", "--target", "{tmp}/target.csv", "--out",
                 "{tmp}/out/pred.csv"], list(expected), {"curves.csv": curves, "target.csv": target})


def replan(event: str, *expected: str, plan: str = PLAN) -> Case:
    return Case(["replan", "{tmp}/plan.yaml", "--event", event, "--out", "{tmp}/out/new.yaml"], list(expected),
                {"plan.yaml": plan})


def flops(tokens: str, *expected: str) -> Case:
    return Case(["flops", "--preset", "tiny", "--tokens", tokens], list(expected), out=None)


CURVES_HEADER = "run,params,step,tokens,lr,loss\n"
CURVES = CURVES_HEADER + "a,1e6,10,1000,0.001,3.5\na,1e6,20,2000,0.001,3.0\nb,2e6,10,1000,0.001,3.4\n"
TARGET = "run,params,step,tokens,lr\nt,4e6,10,1000,0.001\n"
TINY_RUN = dump_yaml(override(presets.get("tiny"), {"train.steps": 2}))  # an existing run's OUT/config.yaml
LADDER = {"target": {"preset": "tiny"}, "rungs": [[32, 2], [48, 2]]}

CASES = {
    # configs: non-finite numbers wherever a float goes, wrong types, unknown keys, cross-field rules
    "yaml capacity_factor .inf": train_yaml("model:\n  moe:\n    capacity_factor: .inf\n",
                                            "model.moe.capacity_factor=inf", "finite"),
    "yaml lr 1e999": train_yaml("train:\n  lr: 1e999\n", "train.lr='1e999'", "finite"),
    "yaml lr 1.0e+999": train_yaml("train:\n  lr: 1.0e+999\n", "train.lr=inf", "finite"),  # a YAML float
    "yaml weight_decay -.inf": train_yaml("train:\n  weight_decay: -.inf\n", "train.weight_decay=-inf", "finite"),
    "yaml rope_theta .nan": train_yaml("model:\n  rope_theta: .nan\n", "model.rope_theta=nan", "finite"),
    "yaml heldout .nan": train_yaml("data:\n  heldout_fraction: .nan\n", "data.heldout_fraction=nan", "finite"),
    "yaml grad ceiling .inf": train_yaml("monitor:\n  grad_norm_ceiling: .inf\n", "monitor.grad_norm_ceiling=inf"),
    "yaml tokens_per_s .inf": train_yaml("plan:\n  tokens_per_s: .inf\n", "plan.tokens_per_s=inf", "finite"),
    "yaml phase fraction .nan": train_yaml(
        "data:\n  phases:\n    - {name: all, fraction: .nan, weights: {code: 1}}\n",
        "data.phases[0].fraction=nan", "finite"),
    "yaml steps .inf": train_yaml("train:\n  steps: .inf\n", "train.steps=inf", "int"),
    "yaml steps text": train_yaml("train:\n  steps: ten\n", "train.steps='ten'", "int"),
    "yaml lr text": train_yaml("train:\n  lr: fast\n", "train.lr='fast'", "must be a number"),
    "yaml moe not a mapping": train_yaml("model:\n  moe: 3\n", "model.moe must be a mapping", "3"),
    "yaml unknown key": train_yaml("model:\n  d_model: 64\n  widht: 3\n", "Unknown key model.widht"),
    "yaml latent as wide as model": train_yaml("model:\n  moe:\n    latent_dim: 64\n",
                                               "model.moe.latent_dim=64", "model.d_model=64"),
    "yaml latent wider than model": train_yaml("model:\n  d_model: 64\n  moe:\n    latent_dim: 128\n",
                                               "model.moe.latent_dim=128", "smaller than model.d_model=64"),
    # --set
    "set lr .inf": train_set("train.lr=.inf", "train.lr=inf", "finite"),
    "set lr -.inf": train_set("train.lr=-.inf", "train.lr=-inf", "finite"),
    "set lr .nan": train_set("train.lr=.nan", "train.lr=nan", "finite"),
    "set capacity 1e999": train_set("model.moe.capacity_factor=1e999", "model.moe.capacity_factor='1e999'"),
    "set deadline 1e999": train_set("plan.deadline_hours=1e999", "plan.deadline_hours='1e999'", "finite"),
    "set steps text": train_set("train.steps=abc", "train.steps='abc'", "int"),
    "set unknown key": train_set("model.moe.bogus=1", "Unknown key model.moe.bogus"),
    "set latent too wide": train_set("model.moe.latent_dim=64", "model.moe.latent_dim=64", "model.d_model=64"),
    # data
    "data missing file": own_data("{tmp}/missing.txt", "data.domains[mine].paths", "missing.txt", "does not exist"),
    "data directory": own_data("{tmp}/corpus", "data.domains[mine].paths", "corpus is a directory",
                               files={"corpus": DIRECTORY}),
    "data empty file": own_data("{tmp}/empty.txt", "data.domains[mine].paths", "empty.txt", "is empty",
                                files={"empty.txt": ""}),
    "data domain without name": train_yaml("data:\n  domains:\n    - {kind: files, paths: [a.txt]}\n",
                                           "data.domains[0].name is required"),
    "data weight not a number": train_yaml(
        "data:\n  phases:\n    - {name: all, fraction: 1.0, weights: {code: lots, prose: 1}}\n",
        "data.phases[0].weights.code='lots'", "must be a number"),
    "data weight .inf": train_yaml(
        "data:\n  phases:\n    - {name: all, fraction: 1.0, weights: {code: .inf, prose: 1}}\n",
        "data.phases[0].weights.code=inf", "finite"),
    "data weight for unknown domain": train_yaml(
        "data:\n  phases:\n    - {name: all, fraction: 1.0, weights: {code: 1, poetry: 1}}\n",
        "data.phases[all].weights", "poetry"),
    # mesh
    "mesh expert=3": train_mesh("expert=3", "mesh.expert=3", "model.moe.num_experts=8"),
    "mesh foo=2": train_mesh("foo=2", "--mesh 'foo=2'"),
    "mesh expert=two": train_mesh("expert=two", "--mesh expert='two'"),
    "mesh more devices than exist": train_mesh("replica=16", "replica=16", "needs 16 devices"),
    # resume: a changed model field on an existing --out leaves it as it was
    "resume with another d_model": Case(
        ["train", "--preset", "tiny", "--steps", "2", "--set", "model.d_model=128", "--out", OUT],
        ["model.d_model: 64 -> 128", "new --out"], {"out/config.yaml": TINY_RUN}),
    # ladder fit CSVs
    "curves loss inf": ladder_fit(CURVES_HEADER + "a,1e6,10,1000,0.001,inf\n" + CURVES[len(CURVES_HEADER):], TARGET,
                                  "curves.csv line 2", "'loss'", "'inf'", "not finite"),
    "curves tokens 1e999": ladder_fit(CURVES + "b,2e6,20,1e999,0.001,3.1\n", TARGET,
                                      "curves.csv line 5", "'tokens'", "'1e999'"),
    "curves step nan": ladder_fit(CURVES + "b,2e6,nan,2000,0.001,3.1\n", TARGET, "line 5", "'step'", "'nan'"),
    "target params -inf": ladder_fit(CURVES, "run,params,step,tokens,lr\nt,-inf,10,1000,0.001\n",
                                     "target.csv line 2", "'params'", "'-inf'"),
    "curves missing column": ladder_fit("run,params,step,tokens,lr\na,1e6,10,1000,0.001\n", TARGET,
                                        "curves.csv lacks column(s) loss"),
    # ladder recipes
    "recipe rung .inf": Case(["ladder", "plan", "{tmp}/recipe.yaml"], ["recipe.yaml: rungs=[[32, inf], [48, 2]]"],
                             {"recipe.yaml": "target: {preset: tiny}\nrungs: [[32, .inf], [48, 2]]\n"}, out=None),
    "recipe target lr .nan": Case(["ladder", "plan", "{tmp}/recipe.yaml"], ["recipe.yaml: train.lr=nan", "finite"],
                                  {"recipe.yaml": "target: {preset: tiny, overrides: {train.lr: .nan}}\n"
                                                  "rungs: [[32, 2], [48, 2]]\n"}, out=None),
    # lab
    "spec band .inf": spec(SPEC.replace("band: [null, 2.5]", "band: [null, .inf]"), "prediction.band=[None, inf]"),
    "spec expected .nan": spec(SPEC.replace("expected: 2.0", "expected: .nan"), "prediction.expected=nan", "finite"),
    "spec config lr .inf": spec(SPEC.replace("train.seed: 0", "train.lr: .inf"), "config:", "train.lr=inf"),
    "spec resources .inf": spec_with({"resources": {"num_gpus": float("inf")}}, "resources={'num_gpus': inf}"),
    "spec ladder rung .inf": spec_with({"config": None, "ladder": {**LADDER, "rungs": [[32, float("inf")], [48, 2]]}},
                                       "ladder: rungs=", "inf", "integers >= 1"),
    "spec ladder batch 1e999": spec_with({"config": None, "ladder": {**LADDER, "rung_batch_size": "1e999"}},
                                         "rung_batch_size='1e999'"),
    "spec unknown field": spec(SPEC + "budget: 3\n", "unknown key budget"),
    "lab run of an unknown id": Case(
        ["lab", "run", "nope", "--ledger", "{tmp}/lab/ledger.sqlite", "--root", OUT], ["unknown experiment id 'nope'"],
        {"spec.yaml": SPEC}, before=["lab", "register", "{tmp}/spec.yaml", "--ledger", "{tmp}/lab/ledger.sqlite"]),
    # replan
    "replan unknown event": replan("bogus:step=1,count=2", "unknown kind 'bogus'"),
    "replan count .inf": replan("devices_lost:step=1200,count=.inf", "event.count='.inf'", "whole number"),
    "replan count 1e999": replan("devices_lost:step=1200,count=1e999", "event.count='1e999'", "whole number"),
    "replan plan tokens_per_s .inf": replan("devices_lost:step=1200,count=8", "plan.tokens_per_s=inf", "finite",
                                            plan=PLAN.replace("tokens_per_s: 65536.0", "tokens_per_s: .inf")),
    "replan plan deadline .nan": replan("devices_lost:step=1200,count=8", "plan.deadline_hours=nan", "finite",
                                        plan=PLAN.replace("deadline_hours: 92.0", "deadline_hours: .nan")),
    # flops
    "flops tokens 1e999": flops("1e999", "--tokens=inf"),
    "flops tokens -5": flops("-5", "--tokens=-5"),
    "flops tokens 1.5": flops("1.5", "--tokens=1.5"),
}


def _snapshot(path: Path) -> dict[str, bytes] | None:
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_naming_the_field_and_value_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is DIRECTORY:
            path.mkdir()
        else:
            path.write_text(fill(content))
    if case.before is not None:
        assert run_cli([fill(a) for a in case.before], monkeypatch, capsys)[0] == 0
    out = Path(fill(case.out)) if case.out is not None else None
    before = _snapshot(out) if out is not None else None

    code, _, err = run_cli([fill(a) for a in case.args], monkeypatch, capsys)

    message = " ".join(err.split())
    assert code == 2, err
    assert "Traceback" not in err
    for text in case.expected:
        assert fill(text) in message, f"{text!r} is not in: {message}"
    if out is not None:
        assert _snapshot(out) == before  # None: still absent
