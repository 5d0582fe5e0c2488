"""spectune: a target tuned with QLoRA, a draft that thinks like it, speculative decoding on llama.cpp."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("spectune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
