"""End to end on the micro pair: every stage runs, the manifest is complete, a second run skips everything,
an interrupted run resumes, and a broken config is refused with all its errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from spectune.bench.config import BenchConfig
from spectune.cache import path_hash
from spectune.cli.run import print_story
from spectune.config import read_yaml, validate
from spectune.data.read import read_dialogues, write_jsonl
from spectune.errors import SpectuneError
from spectune.pipeline.config import (
    DEMO_SETTINGS,
    DRAFT_FIELDS,
    TARGET_FIELDS,
    DataSettings,
    DraftsSettings,
    ModelsSettings,
    RunConfig,
    load_run_config,
)
from spectune.pipeline.run import run_pipeline
from spectune.pipeline.stages import Context, base_draft_stage, domain_data, stages
from spectune.runtime.chosen import ChosenPair
from spectune.serve.config import ServeConfig
from spectune.train.draft import TARGET_ANSWERS

DATA = Path(__file__).parent / "data"
CONFIGS = Path(__file__).parent.parent / "configs"
STAGES = ["data", "target", "finetune", "merge", "base-draft", "draft:sft", "export", "acceptance", "bench"]


def micro_config(run_dir, models_dir) -> RunConfig:
    values = {
        "run_dir": str(run_dir),
        "threads": 1,
        "data": {"demo_dialogues": 200},
        "models": {"size": "micro", "models_dir": str(models_dir)},
        "finetune": {"max_steps": 20, "lr": 5e-3, "max_seq_length": 192, "max_eval": 8},
        "drafts": {"methods": ["sft"], "max_steps": 10, "lr": 3e-3, "max_seq_length": 192, "max_eval": 8},
        "acceptance": {"n": 3, "max_tokens": 16, "draft_types": ["Q4_K_M", "Q8_0"]},
        "export": {"fidelity_dialogues": 2},
        "bench": {"n": 2, "repeats": 1, "max_tokens": 16, "draft_max": 4},
    }
    return validate(RunConfig, values, "test")


def test_pipeline_runs_skips_and_resumes(micro_pair, tmp_path, monkeypatch, capsys):
    config = micro_config(tmp_path / "run", micro_pair.parent)
    import spectune.pipeline.stages as stages_module  # the stage functions call the entry functions it imported

    real_train_draft = stages_module.train_draft
    calls = []

    def interrupted(draft_config):
        calls.append(draft_config.resume)
        raise KeyboardInterrupt  # Ctrl-C in the middle of the draft stage

    monkeypatch.setattr(stages_module, "train_draft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(config)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["finetune"]["status"] == "done"
    assert manifest["stages"]["draft:sft"]["status"] == "running"

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(stages_module, "finetune", must_not_run)
    monkeypatch.setattr(stages_module, "train_draft", lambda c: calls.append(c.resume) or real_train_draft(c))
    capsys.readouterr()
    summary = run_pipeline(config)  # resumes at the unfinished stage
    assert calls == [False, True]  # the interrupted stage continues from its checkpoint
    # The story and nothing else: a line when a stage starts and one with its figure when it ends (or that it was
    # skipped), the trainers' progress lines; what the libraries and the stages said is in logs/STAGE.log.
    printed = capsys.readouterr()
    pattern = re.compile(r"^(✓ )?\d+/\d+ [\w:-]+(: | \.\.\.$)|^draft sft: \d+/\d+, loss ")
    assert all(pattern.match(line) for line in printed.out.splitlines()), printed.out
    assert re.search(r"^✓ \d+/\d+ draft:sft: sft, \d+ steps, eval loss [\d.]+ -> [\d.]+ \(\d+ s\)$", printed.out, re.M)
    assert "finetune: unchanged, skipped" in printed.out and printed.err == ""
    assert "parameters" in (config.layout.logs / "draft-sft.log").read_text()  # the stage's own words, kept
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert list(manifest["stages"]) == STAGES
    assert all(stage["status"] == "done" and stage["seconds"] >= 0 for stage in manifest["stages"].values())
    assert set(manifest["versions"]) >= {"torch", "transformers", "trl", "peft", "bitsandbytes", "llama-cpp-python"}
    assert manifest["config"]["models"]["size"] == "micro"
    assert "identical answers" in summary["line"] and "predicted on a GPU" in summary["line"]
    capsys.readouterr()  # what the stages printed before
    print_story(summary, config.layout)  # the demo's last lines: one row per draft, then why CPU and GPU differ
    story = capsys.readouterr().out
    assert all(f"{name} " in story for name in ("generic", "sft")) and story.count("2/2") == 2, story
    rows = [line for line in story.splitlines() if "2/2" in line]
    assert len(rows) == 2 and all(line.split()[1] in ("generic", "sft") for line in rows), story  # a row a line
    assert max(len(line) for line in story.splitlines()) <= 80, story  # fits an 80-column terminal
    assert "Why CPU and GPU differ" in story

    assert summary["bench"]["sft"]["identical"] == 2
    # One c per draft: the acceptance stage chose k with the c the bench predicts with (what a step reads)
    acceptance = json.loads(config.layout.acceptance.read_text())
    for row in acceptance["drafts"]:
        assert row["cost_ratio"]["gpu"] == round(summary["bench"][row["name"]]["gpu_cost_ratio"], 4)
    assert (tmp_path / "run" / "report.md").is_file()
    written = json.loads((tmp_path / "run" / "gguf" / "pair.json").read_text())
    assert not any(Path(written[key]).is_absolute() for key in ("target", "draft", "target_hf", "draft_hf"))
    chosen = ChosenPair.read(config.layout.chosen_pair)
    assert chosen.target_hf and chosen.target_hf.resolve() == tmp_path / "run" / "target" / "merged"  # vLLM's input
    assert chosen.draft_hf and (chosen.draft_hf / "config.json").is_file() and chosen.draft_name in str(chosen.draft_hf)
    # Each draft measured at both types; pair.json and the bench serve the type chosen for it
    swept = acceptance["draft_types"]["drafts"]
    assert set(swept) == {"generic", "sft"}
    for entry in swept.values():  # plain, and weighted by the matrix where the export used one
        assert {row["quant"] for row in entry["types"]} == {"Q4_K_M", "Q8_0"}
        assert entry["chosen"] in [row["label"] for row in entry["types"]]
    assert chosen.draft.resolve() == Path(swept[chosen.draft_name]["gguf"]).resolve()
    benched = json.loads((config.layout.bench_dir / "report.json").read_text())["drafts"]
    assert benched == {name: entry["gguf"] for name, entry in swept.items()}
    assert "### Draft types" in (tmp_path / "run" / "report.md").read_text()

    monkeypatch.setattr(stages_module, "train_draft", must_not_run)
    before = {name: stage["seconds"] for name, stage in manifest["stages"].items()}
    real_bench = stages_module.bench
    monkeypatch.setattr(stages_module, "bench", must_not_run)
    run_pipeline(config)  # nothing changed: every stage is skipped
    after = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert {name: stage["seconds"] for name, stage in after.items()} == before

    reran = []
    monkeypatch.setattr(stages_module, "bench", lambda c: reran.append(c) or real_bench(c))
    run_pipeline(config, only="bench")  # --only reruns that stage, unchanged as it is, and nothing else
    assert len(reran) == 1
    after = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert {name: stage["seconds"] for name, stage in after.items() if name != "bench"} == {
        name: seconds for name, seconds in before.items() if name != "bench"
    }

    # The run folder is self-contained: moved elsewhere, it is served from any directory.
    moved = tmp_path / "elsewhere" / "moved-run"
    shutil.move(tmp_path / "run", moved)
    monkeypatch.chdir(tmp_path / "elsewhere")
    served = ServeConfig(run=Path("moved-run"))
    assert served.target.is_file() and served.draft.is_file() and served.draft_max == chosen.k
    assert (moved / "gguf" / "llama-server.sh").read_text().count(str(tmp_path)) == 0


def test_a_broken_config_is_refused_with_every_error(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": {"path": str(tmp_path / "missing.jsonl")},
                "finetune": {"lora_r": "big", "colour": "blue"},
                "bench": {"n": 0},
            }
        )
    )
    with pytest.raises(SpectuneError) as caught:
        load_run_config(path)
    fields = {problem.field for problem in caught.value.problems}
    assert {"finetune.lora_r", "finetune.colour", "bench.n"} <= fields
    assert run_cli("run", str(path)) == 2
    err = capsys.readouterr().err
    assert "[finetune.lora_r]" in err and "[finetune.colour]" in err and "[bench.n]" in err
    path.write_text(yaml.safe_dump({"data": {"path": str(tmp_path / "missing.jsonl")}}))
    with pytest.raises(SpectuneError, match="no such file or folder"):
        load_run_config(path)
    path.write_text("data: [unclosed\n")
    assert run_cli("run", str(path)) == 2
    assert "invalid YAML" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "bench": {"n": 2}}))
    assert run_cli("run", "--config", str(path)) == 2  # the run config given as --config: said as such
    err = capsys.readouterr().err
    assert "bench, run_dir: not settings of this command" in err and "RUN_CONFIG argument" in err
    assert "Extra inputs" not in err


def test_a_changed_eval_file_reruns_what_reads_it_and_nothing_else(micro_pair, demo_data, tmp_path):
    """The stale-result bug: acceptance, export and bench read the eval file, so a new one must rerun them (and the
    data stage that copies it), while the models, the fine-tune, the merge and the drafts stay as they were."""
    dialogues = read_dialogues(demo_data).dialogues
    eval_file = tmp_path / "eval.jsonl"
    write_jsonl(dialogues[:6], eval_file)
    config = micro_config(tmp_path / "run", micro_pair.parent)
    config = config.model_copy(update={"data": DataSettings(path=demo_data, eval_data=eval_file)})
    run_pipeline(config)
    manifest = tmp_path / "run" / "manifest.json"
    first = json.loads(manifest.read_text())["stages"]
    write_jsonl(dialogues[6:12], eval_file)  # same name, other prompts
    run_pipeline(config)
    second = json.loads(manifest.read_text())["stages"]
    reran = {name for name in first if second[name]["started"] != first[name]["started"]}
    assert reran == {"data", "export", "acceptance", "bench"}
    assert second["acceptance"]["inputs"] != first["acceptance"]["inputs"]
    assert second["finetune"]["inputs"] == first["finetune"]["inputs"]


def test_the_users_model_folders_are_read_by_content(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    config = validate(RunConfig, {"models": {"target": str(target), "draft": str(draft)}}, "test")
    table = {stage.name: stage for stage in stages(config)}
    context = Context(config, config.layout, {})
    assert table["target"].reads(context) == [target] and table["base-draft"].reads(context) == [draft]
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    before = path_hash(target)
    (target / "model.safetensors").write_bytes(b"retrained")  # same name, new weights: the runs after it are stale
    assert path_hash(target) != before
    derived = validate(RunConfig, {"models": {"target": str(target), "draft": "target-layers"}}, "test")
    base_draft = next(stage for stage in stages(derived) if stage.name == "base-draft")
    assert base_draft.reads(Context(derived, derived.layout, {})) == []


def test_a_new_draft_shape_reruns_the_drafts_not_the_fine_tune():
    assert set(ModelsSettings.model_fields) == TARGET_FIELDS | DRAFT_FIELDS  # every field is hashed by one stage
    config = validate(RunConfig, {"models": {"fetch": "smollm2-135m-instruct", "draft": "target-layers"}}, "test")
    reshaped = config.model_copy(update={"models": config.models.model_copy(update={"draft_layers": [0, 1, 2]})})
    table = {stage.name: stage for stage in stages(config)}
    assert table["target"].settings(config) == table["target"].settings(reshaped)
    assert table["base-draft"].settings(config) != table["base-draft"].settings(reshaped)
    assert table["finetune"].needs == ("target",) and table["merge"].needs == ("target", "finetune")
    assert "base-draft" in table["draft:sft"].needs


def test_draft_layers_cut_a_draft_model_to_its_first_layers(micro_pair, tmp_path):
    """A narrower sibling: `draft_layers` with a draft model keeps those of its layers; without, all of it."""
    from transformers import AutoConfig

    sibling = micro_pair / "target"  # two layers (the micro draft has one)
    models = {"target": str(micro_pair / "target"), "draft": str(sibling)}
    whole = validate(RunConfig, {"run_dir": str(tmp_path / "whole"), "models": models}, "test")
    outputs = {"target": models}
    assert base_draft_stage(Context(whole, whole.layout, outputs)) == {"draft": str(sibling)}
    cut = validate(RunConfig, {"run_dir": str(tmp_path / "cut"), "models": {**models, "draft_layers": [0]}}, "test")
    folder = Path(base_draft_stage(Context(cut, cut.layout, outputs))["draft"])
    assert folder == cut.layout.derived_draft
    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 1
    assert AutoConfig.from_pretrained(sibling).num_hidden_layers == 2


def test_the_stage_table_declares_what_each_stage_reads():
    config = validate(RunConfig, {"drafts": {"methods": ["sft", "seqkd"]}}, "test")
    table = {stage.name: stage for stage in stages(config)}
    assert list(table) == [
        "data",
        "target",
        "finetune",
        "merge",
        "base-draft",
        "draft:sft",
        "draft:seqkd",
        "export",
        "acceptance",
        "bench",
    ]
    # acceptance takes c from the exported GGUFs, and chooses the pair to serve
    assert table["acceptance"].needs == ("target", "merge", "base-draft", "draft:sft", "draft:seqkd", "export")
    assert "acceptance" not in table["export"].needs and "acceptance" in table["bench"].needs
    seqkd, sft = table["draft:seqkd"].settings(config), table["draft:sft"].settings(config)
    # no overrides: the same settings, and seqkd's answers come from the target's file as it is served
    assert seqkd[0] == {**sft[0], "answers_quant": config.export.quant}
    served_q8 = config.model_copy(update={"export": config.export.model_copy(update={"quant": "q8_0"})})
    assert table["draft:seqkd"].settings(served_q8)[0]["answers_quant"] == "Q8_0"
    assert table["draft:sft"].settings(served_q8) == sft  # a draft trained on the data does not rerun
    told = config.model_copy(update={"drafts": config.drafts.model_copy(update={"answers_quant": "Q6_K"})})
    assert table["draft:seqkd"].settings(told)[0]["answers_quant"] == "Q6_K"
    with pytest.raises(SpectuneError, match="unknown quant type 'Q3'"):
        validate(RunConfig, {"drafts": {"answers_quant": "Q3"}}, "test")
    with_override = config.model_copy(
        update={"drafts": DraftsSettings(methods=["sft", "seqkd"], overrides={"seqkd": {"max_train": 5}})}
    )
    assert table["draft:seqkd"].settings(with_override) != table["draft:sft"].settings(with_override)


def test_a_method_started_from_another_trains_after_it_and_reruns_with_it():
    drafts = {"methods": ["speckd", "sft", "seqkd"], "start_from": {"speckd": "seqkd"}}
    config = validate(RunConfig, {"drafts": drafts}, "test")
    names = [stage.name for stage in stages(config)]
    assert names.index("draft:seqkd") < names.index("draft:speckd")
    table = {stage.name: stage for stage in stages(config)}
    assert "draft:seqkd" in table["draft:speckd"].needs and "draft:seqkd" not in table["draft:sft"].needs
    for start_from, error in (({"speckd": "kd"}, "must both be in methods"), ({"speckd": "speckd"}, "cycle")):
        with pytest.raises(SpectuneError) as raised:
            validate(RunConfig, {"drafts": {**drafts, "start_from": start_from}}, "test")
        assert error in str(raised.value), raised.value
    with pytest.raises(SpectuneError):
        validate(RunConfig, {"drafts": {**drafts, "start_from": {"speckd": "seqkd", "seqkd": "speckd"}}}, "test")


def test_the_12b_config_a_user_copies_parses_resolves_and_plans(tmp_path, capsys):
    """configs/gemma-12b.yaml with its paths pointed at folders holding the 12B's and 1B's shapes: every stage's
    settings resolve and the memory plan is the 12B's (nothing runs)."""
    for name, shape in (("gemma-3-12b-it", "gemma3-12b-config.json"), ("gemma-3-1b-it", "gemma3-1b-config.json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((DATA / shape).read_text())
    (tmp_path / "transcripts.jsonl").write_text((DATA / "sgd_dev_sample.jsonl").read_text())
    text = (CONFIGS / "gemma-12b.yaml").read_text()
    for path in ("/models/", "/data/calls/"):
        text = text.replace(path, f"{tmp_path}/")
    (tmp_path / "run.yaml").write_text(text.replace("runs/gemma-12b", str(tmp_path / "run")))
    capsys.readouterr()
    assert run_cli("run", str(tmp_path / "run.yaml"), "--dry-run") == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(plan["stages"]) == [stage.name for stage in stages(load_run_config(tmp_path / "run.yaml"))]
    assert {"draft:sft", "draft:kd"} <= plan["stages"].keys()
    assert plan["stages"]["finetune"]["settings"][0]["lora_r"] == 16
    assert 11.7e9 < plan["memory_plan"]["estimate"]["params"] < 11.8e9
    assert plan["memory_plan"]["fits"]["QLoRA training, gradient checkpointing"]
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.parametrize("size", DEMO_SETTINGS)
def test_every_demo_size_is_a_valid_run_config(size):
    config = validate(RunConfig, {"models": {"size": size}, **DEMO_SETTINGS[size]}, "demo")
    assert config.models.size == size and (config.drafts.methods or config.drafts.assistant)  # something to train


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_config_is_valid(path):
    # Only the settings are checked: the data and models a config names live outside the repository, and no path
    # is opened. `*-bench.yaml` files are `spectune bench --config` files.
    schema = BenchConfig if path.stem.endswith("-bench") else RunConfig
    validate(schema, read_yaml(path), str(path))


def test_a_benchmarks_bench_override_changes_the_bench_stage_alone(monkeypatch):
    # `benchmarks/speculative.py demo:demo --peer` turns llama.cpp's peer on for a config that leaves it off.
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from pipeline_run import config_from_command_line

    plain = config_from_command_line("demo:micro")
    peered = config_from_command_line("demo:micro", {"bench": {"peer": True}})
    assert not plain.bench.peer and peered.bench.peer
    changed = [stage.name for stage in stages(plain) if stage.settings(plain) != stage.settings(peered)]
    assert changed == ["bench"]
    with pytest.raises(SpectuneError) as refused:
        config_from_command_line("demo:micro", {"bench": {"n": 0, "pier": True}})
    assert {problem.field for problem in refused.value.problems} == {"n", "pier"}


def test_the_ngram_domain_table_reads_seqkds_target_answers_where_there_are_some(tmp_path):
    """drafts.ngram: the domain table is the tuned target's own answers (seqkd writes them), else the train file; a
    new answers file reruns the acceptance and bench stages."""
    values = {"run_dir": str(tmp_path), "drafts": {"methods": ["sft", "seqkd"], "ngram": {}}}
    config = validate(RunConfig, values, "test")
    context = Context(config, config.layout, {})
    table = {stage.name: stage for stage in stages(config)}
    assert domain_data(context) == config.layout.train_file
    answers = config.layout.draft_dir("seqkd") / TARGET_ANSWERS
    answers.parent.mkdir(parents=True)
    answers.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi."}]}\n')
    assert domain_data(context) == answers
    assert all(answers in table[name].reads(context) for name in ("acceptance", "bench"))
    plain = validate(RunConfig, {**values, "drafts": {"methods": ["sft", "seqkd"]}}, "test")
    assert all(answers not in table[name].reads(Context(plain, plain.layout, {})) for name in ("acceptance", "bench"))


def test_an_eagle3_head_trains_after_seqkd_on_its_answers_and_is_exported_and_measured(tmp_path):
    values = {"run_dir": str(tmp_path), "drafts": {"methods": ["sft", "seqkd"], "eagle3": {"max_steps": 5}}}
    config = validate(RunConfig, values, "test")
    table = {stage.name: stage for stage in stages(config)}
    names = list(table)
    assert names.index("draft:seqkd") < names.index("eagle3") < names.index("export")
    assert table["eagle3"].needs == ("merge", "draft:seqkd")
    assert all("eagle3" in table[name].needs for name in ("export", "acceptance"))
    answers = config.layout.draft_dir("seqkd") / TARGET_ANSWERS
    answers.parent.mkdir(parents=True)
    answers.write_text("{}\n")
    assert table["eagle3"].reads(Context(config, config.layout, {})) == [answers]
    assert table["eagle3"].settings(config) != table["eagle3"].settings(
        validate(RunConfig, {**values, "drafts": {**values["drafts"], "eagle3": {"max_steps": 6}}}, "test")
    )
    head = {"eagle3": {"model": str(tmp_path / "head")}, "base-draft": {"draft": "d"}, "draft:sft": {"model": "s"}}
    head["draft:seqkd"] = {"model": "q"}
    assert list(Context(config, config.layout, head).drafts()) == ["generic", "sft", "seqkd", "eagle3"]
    without = validate(RunConfig, {"run_dir": str(tmp_path)}, "test")
    assert "eagle3" not in [stage.name for stage in stages(without)]
