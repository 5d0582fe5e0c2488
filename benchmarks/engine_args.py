"""Check the commands `spectune export --for vllm|sglang` writes against the engines' own argument parsers.

vLLM and SGLang need GPUs to serve, but their command-line parsers are plain Python: this script installs each
engine's released wheel (no dependencies, plus the few pure-Python modules its parser imports) into the user cache,
and in a child process per engine parses the exact command from a hand-off's handoff.json with the engine's own
parser: vLLM's `vllm serve` arguments (FlexibleArgumentParser) with its SpeculativeConfig fields and methods,
SGLang's ServerArgs.add_cli_args. A misspelt flag, an unknown speculative key or method fails here.

Usage: python benchmarks/engine_args.py RUN_DIR [--name NAME]   (after `spectune export --for vllm RUN_DIR` and
`--for sglang`; a run that serves an EAGLE-3 head is handed off with vLLM's "eagle3" method and SGLang's EAGLE3)
Writes benchmarks/results/engine_args[_NAME].json. Needs PyPI (~400 MB of wheels, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import typing
from pathlib import Path

from spectune.cache import cache_root
from spectune.engines.handoff import CHECKED_AGAINST, HANDOFF_REPORT

RESULTS = Path(__file__).parent / "results"
# What each engine's argument parser imports, found by importing it (all installed without dependencies, so pip
# never replaces this venv's torch or transformers).
PARSER_MODULES = {
    "vllm": "einops cbor2 openai-harmony cloudpickle cachetools uvloop py-cpuinfo partial-json-parser xgrammar "
    "apache-tvm-ffi llguidance msgspec pyzmq psutil pybase64 orjson aiohttp multidict yarl propcache frozenlist "
    "aiosignal aiohappyeyeballs attrs idna",
    "sglang": "msgspec orjson pybase64 pyzmq triton ipython traitlets decorator matplotlib-inline jedi parso "
    "pexpect ptyprocess prompt-toolkit wcwidth stack-data executing asttokens pure-eval pygments aiohttp multidict "
    "yarl propcache frozenlist aiosignal aiohappyeyeballs attrs idna ipython-pygments-lexers",
}


SGLANG_ALGORITHMS = ("STANDALONE", "EAGLE3")  # a draft model's, an EAGLE-3 head's

# Beyond parsing: what the engine's own definitions say of the values.
ACCEPTED = {
    "vllm": lambda parsed: parsed["method_known"] and not parsed["unknown_speculative_keys"] and parsed["head_runs"],
    "sglang": lambda parsed: parsed["speculative_algorithm"] in SGLANG_ALGORITHMS and parsed["draft_tokens_rule"],
}


def engine_site(engine: str) -> Path:
    """The engine's wheel and its parser's modules, installed once into the user cache."""
    site = cache_root() / "engine-args" / f"{engine}-{CHECKED_AGAINST[engine]}"
    if not (site / ".complete").is_file():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
        subprocess.run([*pip, f"{engine}=={CHECKED_AGAINST[engine]}", *PARSER_MODULES[engine].split()], check=True)
        (site / ".complete").touch()
    return site


def parse_vllm(command: list[str]) -> dict:
    import vllm.platforms
    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm.platforms.current_platform = CpuPlatform()  # the parser's defaults ask for a device; parsing needs none
    assert command[:2] == ["vllm", "serve"], command[:2]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[2:])
    speculative = args.speculative_config
    methods = set(_literal_values(SpeculativeMethod))
    return {
        "model": args.model_tag,
        "speculative_config": speculative,
        "unknown_speculative_keys": sorted(set(speculative) - set(SpeculativeConfig.__dataclass_fields__)),
        "method_known": speculative.get("method") in methods,
    } | vllm_head_classes(Path(args.model_tag), Path(speculative["model"]), speculative.get("method") == "eagle3")


def vllm_head_classes(target: Path, head: Path, eagle3: bool) -> dict:
    """For an EAGLE-3 head, the classes vLLM's own registry loads for the target and the head, and whether the
    target implements SupportsEagle3 (captures its layers' inputs for a head): `head_runs`."""
    if not eagle3:
        return {"head_runs": True}
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    def model_class(folder: Path) -> type:
        return ModelRegistry._try_load_model_cls(json.loads((folder / "config.json").read_text())["architectures"][0])

    target_class, head_class = model_class(target), model_class(head)
    runs = bool(target_class and head_class and supports_eagle3(target_class) and "Eagle3" in head_class.__name__)
    return {"target_class": target_class.__name__, "head_class": head_class.__name__, "head_runs": runs}


def parse_sglang(command: list[str]) -> dict:
    from sglang.srt.server_args import ServerArgs

    assert command[:3] == ["python", "-m", "sglang.launch_server"], command[:3]
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)  # full flag names only
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(command[3:])
    keys = ("model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps")
    parsed = {key: getattr(args, key) for key in (*keys, "speculative_eagle_topk", "speculative_num_draft_tokens")}
    return parsed | {"draft_tokens_rule": args.speculative_num_draft_tokens == args.speculative_num_steps + 1}


def _literal_values(annotation: object) -> list:
    values = []
    for arg in typing.get_args(annotation):
        values += _literal_values(arg) if typing.get_args(arg) else [arg]
    return values


def check(engine: str, handoff: Path) -> dict:
    """Parse the hand-off's command with the engine's own parser, in a child process on the engine's site."""
    report = json.loads((handoff / HANDOFF_REPORT).read_text())
    env = {**os.environ, "PYTHONPATH": str(engine_site(engine))}
    child = subprocess.run(
        [sys.executable, __file__, "--child", engine, report["command"]], capture_output=True, text=True, env=env
    )
    parsed = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else None
    return {
        "engine": f"{engine} {CHECKED_AGAINST[engine]}",
        "command": report["command"],
        "parsed": parsed,
        "accepted": parsed is not None and ACCEPTED[engine](parsed),
        "error": None if parsed else child.stderr.strip()[-2000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path, nargs="?")
    parser.add_argument("--name", help="suffix of the results file (engine_args_NAME.json)")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "COMMAND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine, command = args.child
        parse = parse_vllm if engine == "vllm" else parse_sglang
        print(json.dumps(parse(shlex.split(command))))
        return
    results = {engine: check(engine, args.run / "handoff" / engine) for engine in CHECKED_AGAINST}
    for result in results.values():
        print(f"{result['engine']}: {'accepted' if result['accepted'] else 'REFUSED'}")
        print(f"  {json.dumps(result['parsed']) if result['parsed'] else result['error']}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine_args{'_' + args.name if args.name else ''}.json"
    out.write_text(json.dumps(results, indent=2).replace(str(Path.home()), "~"))
    if not all(result["accepted"] for result in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
