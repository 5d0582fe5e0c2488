"""Where every artifact of a run lives. The one owner of a run directory's layout: the pipeline writes through it;
export, bench, demo, serve and the GPU scripts read through it."""

from __future__ import annotations

from pathlib import Path

DEFAULT_QUANT = "Q4_K_M"  # the GGUF type a run exports to unless its export.quant says otherwise
CONTROL_DRAFT = "generic"  # the untrained draft every tuned one is compared with
TARGET = "target"
# The files an export folder holds besides the GGUFs (export-pair writes them into any folder).
EXPORT_REPORT, CHOSEN_PAIR, SERVER_SCRIPT = "export.json", "pair.json", "llama-server.sh"


def gguf_name(name: str, quant: str) -> str:
    return f"{name}.{quant}.gguf"


class RunLayout:
    """Every path of a run directory; export names GGUFs by `quant`."""

    def __init__(self, root: Path, quant: str = DEFAULT_QUANT) -> None:
        self.root, self.quant = Path(root), quant
        self.manifest = self.root / "manifest.json"
        self.report = self.root / "report.md"
        self.data_dir = self.root / "data"
        self.demo_data = self.data_dir / "dialogues.jsonl"
        self.train_file = self.data_dir / "train.jsonl"
        self.eval_file = self.data_dir / "eval.jsonl"
        self.derived_draft = self.root / "models" / "draft"  # a draft made from the target's layers
        self.target_dir = self.root / "target"  # fine-tuning output: adapter/, checkpoints/, finetune.json
        self.merged_target = self.target_dir / "merged"
        self.acceptance = self.root / "acceptance.json"
        self.profile = self.root / "profile.json"  # the demo pair's hardware profile (c, r(n)) at the run's quant
        self.gguf_dir = self.root / "gguf"
        self.export_report = self.gguf_dir / EXPORT_REPORT
        self.chosen_pair = self.gguf_dir / CHOSEN_PAIR  # the pair to serve and its k (written by acceptance)
        self.server_script = self.gguf_dir / SERVER_SCRIPT
        self.bench_dir = self.root / "bench"
        self.logs = self.root / "logs"  # what the libraries said during each stage (logs/STAGE.log)

    def draft_dir(self, method: str) -> Path:
        """Draft training output: model/, checkpoints/, draft.json."""
        return self.root / "drafts" / method

    def gguf(self, name: str) -> Path:
        """The exported GGUF of the target (name "target") or of a draft."""
        return self.gguf_dir / gguf_name(name, self.quant)
