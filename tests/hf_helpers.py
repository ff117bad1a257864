"""What the Hugging Face conversion tests share: tools/checkpoint/convert.py loaded as a module (it
is a script, not a package member), a conversion run through its main(), and an exported
checkpoint's tensors."""
import importlib.util
import os

from dist_helpers import ROOT


def convert_tool():
    """tools/checkpoint/convert.py as a module (one instance per test module that asks)."""
    spec = importlib.util.spec_from_file_location("megalite_convert", os.path.join(ROOT, "tools/checkpoint/convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_convert(convert, loader: str, saver: str, src, dst, *extra) -> str:
    """One conversion (--loader -> --saver) that must succeed; returns the output directory."""
    assert convert.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(src),
                         "--save-dir", str(dst), *extra]) == 0
    return str(dst)


def safetensors_of(directory) -> dict:
    """The tensors of a one-file Hugging Face checkpoint."""
    from safetensors.torch import load_file
    return load_file(os.path.join(directory, "model.safetensors"))
